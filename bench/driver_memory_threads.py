# Registering host memory: from one thread and from four, with transparent
# huge pages asked for or not, and whether unregistering on one thread holds
# up another thread's driver calls (docs/performance.md, "Third round").
# Usage: python3 bench/driver_memory_threads.py
import ctypes as C, time, numpy as np, mmap, threading
cu = C.CDLL("libcuda.so.1")
def ck(r, what):
    if r != 0: raise SystemExit(f"{what}: CUresult {r}")
print("THP", open("/sys/kernel/mm/transparent_hugepage/enabled").read().strip(), "| defrag", open("/sys/kernel/mm/transparent_hugepage/defrag").read().strip())
ck(cu.cuInit(0), "init")
dev = C.c_int(); ck(cu.cuDeviceGet(C.byref(dev), 0), "dev")
ctx = C.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(C.byref(ctx), dev), "ctx"); ck(cu.cuCtxSetCurrent(ctx), "cur")
S = C.c_void_p(0)
def sync(): ck(cu.cuStreamSynchronize(S), "sync")
def alloc(n):
    p = C.c_uint64(); ck(cu.cuMemAllocAsync(C.byref(p), C.c_size_t(n), S), "alloc"); return p.value
t = time.perf_counter(); p = alloc(256); sync(); print("first tiny alloc: %.2f ms" % (1e3 * (time.perf_counter() - t)))
cu.cuMemFreeAsync(C.c_uint64(p), S); sync()
t = time.perf_counter(); ps = [alloc(46_800_000) for _ in range(4)]; sync(); print("then 187 MB: %.2f ms" % (1e3 * (time.perf_counter() - t)))
N = 46_800_000
def anon(huge):
    m = mmap.mmap(-1, N + (2 << 20))
    if huge: m.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(m, dtype=np.uint8)
    off = (-a.ctypes.data) % (2 << 20)
    v = a[off:off + N].view(np.uint32); v[:] = 7
    return m, v
def register(arrs, piece=16 << 20):
    regs = []; t = time.perf_counter()
    for v in arrs:
        s = v.ctypes.data; e = s + v.nbytes; at = s
        while at < e:
            nx = min((at // piece + 1) * piece, e)
            ck(cu.cuMemHostRegister_v2(C.c_void_p(at), C.c_size_t(nx - at), 0), "reg"); regs.append(at); at = nx
    return regs, 1e3 * (time.perf_counter() - t)
def unregister(regs):
    cu.cuCtxSetCurrent(ctx); t = time.perf_counter()
    for r in regs: cu.cuMemHostUnregister(C.c_void_p(r))
    return 1e3 * (time.perf_counter() - t)
for huge in (False, True, False, True):
    keep = [anon(huge) for _ in range(4)]
    arrs = [v for _, v in keep]
    with open("/proc/self/smaps_rollup") as f: ahp = [l for l in f if l.startswith("AnonHugePages")][0].split()[1]
    regs, ms = register(arrs); um = unregister(regs)
    print(f"huge advised {huge}: register 187 MB {ms:.2f} ms, unregister {um:.2f} ms (AnonHugePages {ahp} kB)")
    regs, ms = register(arrs, 1 << 40); um = unregister(regs); print(f"   whole arrays: register {ms:.2f}, unregister {um:.2f}")
    # 4 threads at once
    out = [None] * 4
    def w(i):
        cu.cuCtxSetCurrent(ctx); out[i] = register([arrs[i]])
    t = time.perf_counter(); th = [threading.Thread(target=w, args=(i,)) for i in range(4)]; [x.start() for x in th]; [x.join() for x in th]
    print(f"   4 threads: register {1e3*(time.perf_counter()-t):.2f} ms")
    allregs = sum((o[0] for o in out), [])
    # unregister on a thread while the main thread allocates and syncs
    th = threading.Thread(target=unregister, args=(allregs,)); t = time.perf_counter(); th.start()
    ts = []
    for i in range(10):
        t1 = time.perf_counter(); q = alloc(1 << 20); sync(); cu.cuMemFreeAsync(C.c_uint64(q), S); sync(); ts.append(1e3 * (time.perf_counter() - t1))
    th.join(); print(f"   unregister on a thread: {1e3*(time.perf_counter()-t):.2f} ms; main alloc+sync ms: {[round(x,2) for x in ts]}")
    del arrs, keep
