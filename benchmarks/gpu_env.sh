# The GPU set-up under its former name, for the scripts that still source it
# (gpu_train_recipe.sh): benchmarks/gpu_setup.sh is the set-up.
source benchmarks/gpu_setup.sh
