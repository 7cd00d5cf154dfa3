// One RWKV-4 step and its reverse, shared by the CPU and CUDA kernels. Per channel, with the max
// trick of DESIGN.md; the state (aa, bb, pp) stands for numerator aa*e^pp and denominator bb*e^pp.
#pragma once

#include <cmath>

#include "common.h"

namespace rwkv_ffi {

struct Wkv4State {
  float aa, bb, pp;
};

// Returns y_t and advances s.
RWKV_HD float wkv4_step(Wkv4State& s, float w, float u, float k, float v) {
  float ww = u + k;
  float p = fmaxf(s.pp, ww);
  float e1 = expf(s.pp - p), e2 = expf(ww - p);
  const float y = (e1 * s.aa + e2 * v) / (e1 * s.bb + e2);
  ww = w + s.pp;
  p = fmaxf(ww, k);
  e1 = expf(ww - p);
  e2 = expf(k - p);
  s.aa = e1 * s.aa + e2 * v;
  s.bb = e1 * s.bb + e2;
  s.pp = p;
  return y;
}

// Reverse of wkv4_step from the state s before the step: g holds dL/d(state after) and becomes
// dL/d(state before); adds to dw, du and returns dk, dv. The shift p of the output's max trick
// cancels exactly (y does not depend on it); the state's shift p = max(w + pp, k) sends its
// gradient to the larger argument (half to each on a tie, as jnp.maximum does).
RWKV_HD void wkv4_step_back(const Wkv4State& s, float w, float u, float k, float v, float dy,
                            Wkv4State& g, float& dw, float& du, float& dk, float& dv) {
  float ww = u + k;
  float p = fmaxf(s.pp, ww);
  float e1 = expf(s.pp - p), e2 = expf(ww - p);
  const float num = e1 * s.aa + e2 * v, den = e1 * s.bb + e2;
  const float dnum = dy / den, dden = -dy * (num / den) / den;
  float daa = dnum * e1, dbb = dden * e1;
  dv = dnum * e2;
  float dpp = (dnum * s.aa + dden * s.bb) * e1;
  const float dww1 = (dnum * v + dden) * e2;
  du += dww1;
  dk = dww1;

  ww = w + s.pp;
  p = fmaxf(ww, k);
  e1 = expf(ww - p);
  e2 = expf(k - p);
  const float df1 = g.aa * s.aa + g.bb * s.bb, df2 = g.aa * v + g.bb;
  daa += g.aa * e1;
  dbb += g.bb * e1;
  dv += g.aa * e2;
  float dww2 = df1 * e1;
  dk += df2 * e2;
  const float dp = g.pp - df1 * e1 - df2 * e2;
  if (ww > k) {
    dww2 += dp;
  } else if (k > ww) {
    dk += dp;
  } else {
    dww2 += 0.5f * dp;
    dk += 0.5f * dp;
  }
  dw += dww2;
  dpp += dww2;
  g = Wkv4State{daa, dbb, dpp};
}

}  // namespace rwkv_ffi
