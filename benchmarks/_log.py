"""The GPU scripts' log: every line is printed and, once ``open_log`` has named a file, written
there too (flushed, so a run cut short keeps what it printed)."""

_file = None


def open_log(path):
    global _file
    _file = open(path, "w")


def log(*parts):
    line = " ".join(str(p) for p in parts)
    print(line, flush=True)
    if _file:
        _file.write(line + "\n")
        _file.flush()
