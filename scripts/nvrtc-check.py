"""Compiles a kernel file as oxrl compiles it on a GPU machine: NVRTC with cudarc's default options
(`compile_ptx`), from the pinned wheel, no GPU needed. Fails with NVRTC's log when the file does
not compile, or when the PTX lacks an `extern "C" __global__` function the file declares (the
names Rust launches).

    bash scripts/cuda-env.sh python3 scripts/nvrtc-check.py crates/oxrl-nn/src/logprob.cu
"""

import ctypes
import glob
import os
import re
import sys


def nvrtc():
    root = os.environ.get("OXRL_CUDA_DIR")
    if not root:
        sys.exit("nvrtc-check: run me through scripts/cuda-env.sh (OXRL_CUDA_DIR is unset)")
    lib = os.path.join(root, "lib")
    # NVRTC opens its builtins by name at compile time; loaded first, they are found.
    for name in ("libnvrtc-builtins.so.*", "libnvrtc.so.*"):
        found = sorted(glob.glob(os.path.join(lib, name)))
        if not found:
            sys.exit(f"nvrtc-check: no {name} in {lib}")
        loaded = ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
    return loaded


def compile_ptx(lib, source, name):
    prog = ctypes.c_void_p()
    check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), source, name, 0, None, None), "create")
    status = lib.nvrtcCompileProgram(prog, 0, None)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if status != 0:
        sys.exit(f"nvrtc-check: {name.decode()} does not compile:\n{log.value.decode()}")
    check(lib, lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "PTX size")
    ptx = ctypes.create_string_buffer(size.value)
    check(lib, lib.nvrtcGetPTX(prog, ptx), "PTX")
    return ptx.value.decode()


def check(lib, status, what):
    if status != 0:
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        sys.exit(f"nvrtc-check: {what}: {lib.nvrtcGetErrorString(status).decode()}")


def main():
    lib = nvrtc()
    for path in sys.argv[1:]:
        source = open(path, "rb").read()
        ptx = compile_ptx(lib, source, os.path.basename(path).encode())
        kernels = re.findall(rb'extern "C" __global__ void (\w+)\(', source)
        missing = [k.decode() for k in kernels if f".entry {k.decode()}(" not in ptx]
        if not kernels or missing:
            sys.exit(f"nvrtc-check: {path}: no entry for {missing or 'any kernel'} in the PTX")
        print(f"nvrtc-check: {path}: {len(kernels)} kernels compile ({', '.join(k.decode() for k in kernels)})")


if __name__ == "__main__":
    main()
