"""Device memory that comes back at the same address: CUDA's virtual memory management (the driver API, through
ctypes), for the engine's KV cache.

`lathe train` frees the KV cache while it trains and takes it back for the next rollout. From PyTorch's allocator the
cache lands where it was only while the allocator kept the memory cached and nothing split it (`LatheEngine.sleep`
keeps it below `KEEP_CACHED_FRACTION` of the device); near the device's limit it goes back to the driver, lands
elsewhere, and every decode graph is captured again (0.06 s a step at 1.5B with the reference on an H100, 0.2 s at
7B on an H200). A `FixedAddress` reserves a virtual address range once and maps physical memory into it only while
the cache is held: `unmap` gives the memory to the driver (the trainer can take all of it) and `map` brings new
memory back under the same addresses, so graphs captured against the cache stay valid whatever happened in between
(vLLM's sleep mode does the same); the graphs are then kept, with their pool, through the update.

On by default; LATHE_KV_FIXED_ADDRESS=0 keeps the cache in PyTorch's allocator. On an H100 at 1.5B with the reference
on, two calls, the graph was no longer captured at every step, the wake-up took 0.008-0.010 s against 0.04-0.08, and
the step 6.77 s against 6.90 and 6.90 against 6.95
(`e2e_fixed_address_ab{3,2}_{1,0}_ref_1.5b_nvidia-h100-80gb-hbm3.json`). PyTorch's allocator keeps the trainer's
cached blocks through the rollout, beside the cache (its reserved memory shows both); an out-of-memory error
at mapping empties them and tries again (`KVCache._fixed_memory`). Unavailable where the driver lacks
it (CPU, another vendor, a driver without VMM): the cache is an ordinary tensor then."""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch

from lathe import device as accel

logger = logging.getLogger(__name__)

_OUT_OF_MEMORY = 2                  # CUDA_ERROR_OUT_OF_MEMORY
_PINNED, _ON_DEVICE, _READ_WRITE = 1, 1, 3  # CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, ..._PROT_READWRITE


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _Prop(ctypes.Structure):      # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DriverError(RuntimeError):
    pass


@functools.cache
def _driver():
    return ctypes.CDLL("libcuda.so.1")


def _check(result: int, call: str) -> None:
    if result == 0:
        return
    text = ctypes.c_char_p()
    _driver().cuGetErrorString(result, ctypes.byref(text))
    message = f"{call}: CUDA driver error {result} ({(text.value or b'?').decode()})"
    if result == _OUT_OF_MEMORY:
        raise torch.OutOfMemoryError(message)
    raise DriverError(message)


def _prop(index: int) -> _Prop:
    prop = _Prop()
    prop.type, prop.location.type, prop.location.id = _PINNED, _ON_DEVICE, index
    return prop


@functools.cache
def supported(index: int) -> bool:
    """Whether device `index` takes fixed-address memory (checked once by mapping and unmapping one granule)."""
    if os.environ.get("LATHE_KV_FIXED_ADDRESS", "1") == "0" or accel.detect().name != "cuda":     # (not ROCm)
        return False
    try:
        probe = FixedAddress(1, torch.device("cuda", index))
        probe.map()
        probe.close()
        return True
    except (OSError, AttributeError, DriverError, torch.OutOfMemoryError) as e:
        logger.info("engine: the KV cache lives in PyTorch's allocator (fixed-address memory unavailable: %s)", e)
        return False


class _Raw:
    """A byte range as `__cuda_array_interface__`, for `torch.as_tensor` (which keeps this object alive)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 3, "strides": None}


class FixedAddress:
    """`nbytes` (rounded up to the driver's granularity) of virtual addresses on `device`, reserved once; `map()`
    backs them with new physical memory and returns it as a uint8 tensor, zeroed; `unmap()` gives that memory back
    to the driver. Tensors taken from `map()` must be dropped before `unmap()`: the addresses stay, the memory goes."""

    def __init__(self, nbytes: int, device: torch.device):
        self.device = device if device.index is not None else accel.current_device("cuda")
        self.index = self.device.index
        with accel.use_device(self.device):
            accel.synchronize(self.device)  # the device's primary context current on this thread for the driver calls
        granule = ctypes.c_size_t()
        prop = _prop(self.index)
        _check(_driver().cuMemGetAllocationGranularity(ctypes.byref(granule), ctypes.byref(prop), 0),
               "cuMemGetAllocationGranularity")
        g = granule.value
        self.requested, self.nbytes = nbytes, -(-nbytes // g) * g
        self.address = ctypes.c_uint64()
        _check(_driver().cuMemAddressReserve(ctypes.byref(self.address), ctypes.c_size_t(self.nbytes),
                                             ctypes.c_size_t(g), ctypes.c_uint64(0), ctypes.c_uint64(0)),
               "cuMemAddressReserve")
        self.handle: ctypes.c_uint64 | None = None

    @property
    def mapped(self) -> bool:
        return self.handle is not None

    def map(self) -> torch.Tensor:
        """Physical memory under the reserved addresses (the same addresses at every call), zeroed."""
        if not self.mapped:
            d = _driver()
            with accel.use_device(self.device):
                accel.synchronize(self.device)  # the primary context current on this thread (a rollout thread's too)
                handle = ctypes.c_uint64()
                prop = _prop(self.index)
                _check(d.cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.nbytes), ctypes.byref(prop),
                                     ctypes.c_uint64(0)), "cuMemCreate")
                try:
                    _check(d.cuMemMap(self.address, ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0), handle,
                                      ctypes.c_uint64(0)), "cuMemMap")
                except BaseException:
                    d.cuMemRelease(handle)
                    raise
                self.handle = handle
                accel.count_mapped(self.device, self.nbytes)
                access = _AccessDesc()
                access.location.type, access.location.id, access.flags = _ON_DEVICE, self.index, _READ_WRITE
                try:
                    _check(d.cuMemSetAccess(self.address, ctypes.c_size_t(self.nbytes), ctypes.byref(access),
                                            ctypes.c_size_t(1)), "cuMemSetAccess")
                except BaseException:
                    self.unmap()
                    raise
        raw = torch.as_tensor(_Raw(self.address.value, self.requested), device=self.device)
        return raw.zero_()

    def unmap(self) -> None:
        if not self.mapped:
            return
        with accel.use_device(self.device):
            accel.synchronize(self.device)  # no kernel still reading the memory
            d = _driver()
            _check(d.cuMemUnmap(self.address, ctypes.c_size_t(self.nbytes)), "cuMemUnmap")
            _check(d.cuMemRelease(self.handle), "cuMemRelease")
        self.handle = None
        accel.count_mapped(self.device, -self.nbytes)

    def close(self) -> None:
        """Unmap and give the addresses back (a reservation of another size replaces this one)."""
        if self.address is None:
            return
        self.unmap()
        _check(_driver().cuMemAddressFree(self.address, ctypes.c_size_t(self.nbytes)), "cuMemAddressFree")
        self.address = None

    def __del__(self):
        try:
            self.close()
        except Exception:       # interpreter shutdown: the driver may be gone already
            pass
