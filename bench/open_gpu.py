"""How long the CUDA driver takes to open GPU 0 from a bare process: the
floor under `kruskal cpd`'s "GPU opened" time (docs/performance.md).
Needs only the driver (libcuda); prints one line."""
import ctypes
import time

t0 = time.perf_counter()
cuda = ctypes.CDLL("libcuda.so.1")
t1 = time.perf_counter()
rc_init = cuda.cuInit(0)
t2 = time.perf_counter()
dev = ctypes.c_int()
cuda.cuDeviceGet(ctypes.byref(dev), 0)
ctx = ctypes.c_void_p()
rc_ctx = cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
t3 = time.perf_counter()
print(
    f"dlopen libcuda {1e3 * (t1 - t0):.1f} ms, cuInit {1e3 * (t2 - t1):.1f} ms (rc {rc_init}), "
    f"primary context {1e3 * (t3 - t2):.1f} ms (rc {rc_ctx})"
)
