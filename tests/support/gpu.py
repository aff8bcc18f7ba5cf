"""Whether this machine has a GPU that CuPy can use (the GPU tests skip without one)."""


def has_gpu() -> bool:
    try:
        import cupy

        return bool(cupy.cuda.runtime.getDeviceCount() > 0)
    except Exception:  # noqa: BLE001 - no cupy, no driver or no device all mean: no GPU
        return False


HAS_GPU = has_gpu()
