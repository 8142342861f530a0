# What the CUDA driver charges for memory on this machine, through ctypes
# (numpy and libcuda only): the first allocation of a process (the memory
# pool set up), allocations after it, registering and unregistering host
# memory, and copies from registered, pageable and pinned memory.
# docs/performance.md, "Third round". Usage: python3 bench/driver_memory.py
import ctypes as C, time, numpy as np, sys
cu = C.CDLL("libcuda.so.1")
def ck(r, what):
    if r != 0: raise SystemExit(f"{what}: CUresult {r}")
t0 = time.perf_counter(); ck(cu.cuInit(0), "init"); t1 = time.perf_counter()
dev = C.c_int(); ck(cu.cuDeviceGet(C.byref(dev), 0), "dev")
ctx = C.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "ctx"); ck(cu.cuCtxSetCurrent(ctx), "cur")
t2 = time.perf_counter()
print(f"init {1e3*(t1-t0):.1f} ms, primary ctx {1e3*(t2-t1):.1f} ms")
pool = C.c_void_p(); ck(cu.cuDeviceGetDefaultMemPool(C.byref(pool), dev), "pool")
thr = C.c_uint64(); ck(cu.cuMemPoolGetAttribute(pool, 4, C.byref(thr)), "getattr"); print("default release threshold", thr.value)
S = C.c_void_p(0)
def sync(): ck(cu.cuStreamSynchronize(S), "sync")
def alloc(sizes):
    ps = []
    t = time.perf_counter()
    for n in sizes:
        p = C.c_uint64(); ck(cu.cuMemAllocAsync(C.byref(p), C.c_size_t(n), S), "alloc"); ps.append(p.value)
    sync()
    return ps, 1e3 * (time.perf_counter() - t)
def free(ps):
    for p in ps: ck(cu.cuMemFreeAsync(C.c_uint64(p), S), "free")
    sync()
coo = [46_800_000] * 4
ps, ms = alloc(coo); print(f"cold async alloc 187 MB: {ms:.2f} ms"); 
t = time.perf_counter()
for p in ps: ck(cu.cuMemsetD32Async(C.c_uint64(p), 0, C.c_size_t(46_800_000 // 4), S), "memset")
sync(); print(f"memset 187 MB: {1e3*(time.perf_counter()-t):.2f} ms")
free(ps)
ps, ms = alloc(coo); print(f"again, threshold 0: {ms:.2f} ms"); free(ps)
big = [100_000_000] * 8
ps, ms = alloc(big); print(f"cold 800 MB: {ms:.2f} ms"); free(ps)
thr.value = 2**64 - 1; ck(cu.cuMemPoolSetAttribute(pool, 4, C.byref(thr)), "setattr")
ps, ms = alloc(big); print(f"800 MB after threshold max (was released): {ms:.2f} ms"); free(ps)
ps, ms = alloc(big); print(f"800 MB again, kept by the pool: {ms:.2f} ms"); free(ps)
ps, ms = alloc(coo + [23_400_000] * 8 + [140_000_000] * 3); print(f"mixed 1 GB from a 800 MB pool: {ms:.2f} ms"); free(ps)
ps, ms = alloc(coo); print(f"187 MB from the kept pool: {ms:.2f} ms")
# Registered upload into these buffers, vs pageable.
a = np.ones(46_800_000 // 4 * 4, dtype=np.uint32)
parts = [a[i * 11_700_000:(i + 1) * 11_700_000].copy() for i in range(4)]
def upload_reg(piece=16 << 20):
    t = time.perf_counter(); regs = []; rt = 0.0
    for part, d in zip(parts, ps):
        start = part.ctypes.data; end = start + part.nbytes; at = start
        while at < end:
            nxt = min((at // piece + 1) * piece, end)
            r0 = time.perf_counter(); ck(cu.cuMemHostRegister_v2(C.c_void_p(at), C.c_size_t(nxt - at), 0), "reg"); rt += time.perf_counter() - r0
            regs.append(at)
            ck(cu.cuMemcpyHtoDAsync_v2(C.c_uint64(d + at - start), C.c_void_p(at), C.c_size_t(nxt - at), S), "copy")
            at = nxt
    sync(); tot = time.perf_counter() - t
    u0 = time.perf_counter()
    for r in regs: cu.cuMemHostUnregister(C.c_void_p(r))
    return 1e3 * tot, 1e3 * rt, 1e3 * (time.perf_counter() - u0)
for i in range(3): print("registered upload 187 MB (total, of which register, unregister) ms: %.2f %.2f %.2f" % upload_reg())
def upload_pageable():
    t = time.perf_counter()
    for part, d in zip(parts, ps): ck(cu.cuMemcpyHtoD_v2(C.c_uint64(d), C.c_void_p(part.ctypes.data), C.c_size_t(part.nbytes)), "copy")
    return 1e3 * (time.perf_counter() - t)
for i in range(2): print("pageable upload 187 MB: %.2f ms" % upload_pageable())
pinned = C.c_void_p(); t = time.perf_counter(); ck(cu.cuMemHostAlloc(C.byref(pinned), C.c_size_t(46_800_000), 0), "hostalloc"); print("cuMemHostAlloc 47 MB: %.2f ms" % (1e3 * (time.perf_counter() - t)))
t = time.perf_counter()
for d in ps: ck(cu.cuMemcpyHtoDAsync_v2(C.c_uint64(d), pinned, C.c_size_t(46_800_000), S), "copy")
sync(); print("pinned upload 187 MB: %.2f ms (%.1f GB/s)" % (1e3 * (time.perf_counter() - t), 0.1872 / (time.perf_counter() - t)))
# fresh host memory (not yet faulted) registered
b = np.empty(46_800_000 // 4, dtype=np.uint32)
t = time.perf_counter(); ck(cu.cuMemHostRegister_v2(C.c_void_p(b.ctypes.data), C.c_size_t(b.nbytes), 0), "reg"); print("register 47 MB never touched: %.2f ms" % (1e3 * (time.perf_counter() - t)))
