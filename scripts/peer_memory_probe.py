"""Evidence for the peer-memory mechanism (docs/gpu.md, "Across processes: peer memory"), run on
a GPU host with PyTorch's image (cupy, cuda-bindings): which CUDA VMM handle types the device
supports (POSIX fd, FABRIC), whether an IMEX channel exists, which NCCL is installed, and whether
three processes on the same GPU map one CUDA IPC allocation and see each other's writes.
Usage: python3 scripts/peer_memory_probe.py"""
import multiprocessing as mp, os, sys

def attrs():
    from cuda.bindings import driver as cu
    cu.cuInit(0)
    _, dev = cu.cuDeviceGet(0)
    A = cu.CUdevice_attribute
    for name in ["CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_IPC_EVENT_SUPPORTED",
                 "CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING"]:
        try:
            print(name, cu.cuDeviceGetAttribute(getattr(A, name), dev))
        except Exception as e:
            print(name, "error", e)
    print("imex channels:", os.listdir("/dev/nvidia-caps-imex-channels") if os.path.exists("/dev/nvidia-caps-imex-channels") else "none")

def child(handle, q):
    import cupy as cp
    try:
        ptr = cp.cuda.runtime.ipcOpenMemHandle(handle)
        mem = cp.cuda.UnownedMemory(ptr, 1 << 20, None)
        a = cp.ndarray((1 << 18,), cp.uint32, cp.cuda.MemoryPointer(mem, 0))
        s = int(a.sum())
        a += 1
        cp.cuda.runtime.deviceSynchronize()
        q.put(("ok", s))
    except Exception as e:
        q.put(("error", repr(e)))

if __name__ == "__main__":
    attrs()
    try:
        import nvidia.nccl, glob
        print("nccl libs:", glob.glob(os.path.dirname(nvidia.nccl.__path__[0]) + "/nccl/lib/*"))
    except Exception as e:
        print("nccl wheel:", e)
    import subprocess
    print(subprocess.run("pip show nvidia-nccl-cu13 2>/dev/null | head -2; ls /usr/lib/x86_64-linux-gnu | grep -i nccl", shell=True, capture_output=True, text=True).stdout)
    ctx = mp.get_context("spawn")
    import cupy as cp
    a = cp.arange(1 << 18, dtype=cp.uint32)
    h = cp.cuda.runtime.ipcGetMemHandle(a.data.ptr)
    q = ctx.Queue()
    procs = [ctx.Process(target=child, args=(h, q)) for _ in range(3)]
    for p in procs: p.start()
    res = [q.get(timeout=60) for _ in procs]
    for p in procs: p.join()
    print("CUDA IPC, 3 processes on the same GPU:", res, "after:", int((a - cp.arange(1 << 18, dtype=cp.uint32)).max()), "(3 = each child's +1 landed)")
