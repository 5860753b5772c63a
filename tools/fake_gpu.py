"""A GPU that is not there: a small C library standing in for the CUDA runtime and driver, for compiling CUDA
code on a machine without a GPU (compile_check.py).

Loaded with LD_PRELOAD (and as libcuda.so.1 for Triton's launcher), it answers the device queries torch,
Inductor and Triton make with the properties of one GPU of GPUS, serves the few small real tensors Inductor
makes while compiling from host memory, checks and counts every module loaded (an ELF cubin for the GPU's
architecture), and refuses everything that would run code. Built with gcc against the CUDA headers Triton
ships, once per GPU, into ~/.cache/modern-llm/fake_gpu/.
"""

import hashlib
import json
import os
import subprocess
from dataclasses import dataclass


@dataclass(frozen=True)
class FakeGPU:
    """The properties the fake device reports (from each card's public specifications)."""
    name: str
    major: int
    minor: int
    sms: int
    memory: int  # bytes, as the driver reports them
    smem_block_optin: int  # shared memory a block may opt in to
    smem_sm: int
    l2: int
    clock_khz: int
    mem_clock_khz: int
    bus_bits: int
    tflops: dict  # dense tensor-core TFLOPS by operand type (NVIDIA's datasheets, without 2:4 sparsity)


GPUS = {
    "h100": FakeGPU("NVIDIA H100 80GB HBM3", 9, 0, 132, 85_520_809_984, 232_448, 233_472, 52_428_800,
                    1_980_000, 2_619_000, 5120, {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9}),
    "h200": FakeGPU("NVIDIA H200", 9, 0, 132, 150_754_820_096, 232_448, 233_472, 62_914_560, 1_980_000,
                    3_125_000, 6144, {"bf16": 989.4, "fp8": 1978.9, "tf32": 494.7, "fp32": 66.9}),  # 4.8 TB/s
    "rtx4090": FakeGPU("NVIDIA GeForce RTX 4090", 8, 9, 128, 25_393_692_672, 101_376, 102_400, 75_497_472,
                       2_520_000, 10_501_000, 384, {"bf16": 165.2, "fp8": 330.3, "tf32": 82.6, "fp32": 82.6}),
    "a100": FakeGPU("NVIDIA A100-SXM4-80GB", 8, 0, 108, 85_097_971_712, 166_912, 167_936, 41_943_040,
                    # no fp8 units
                    1_410_000, 1_593_000, 5120, {"bf16": 312.0, "fp8": 312.0, "tf32": 156.0, "fp32": 19.5}),
}

SHIM = r"""
/* Stands in for libcudart and libcuda: device queries answered for one GPU (FAKE_* macros), memory from
   the host for the few small real tensors Inductor makes while compiling, and no code ever runs. */
#include <driver_types.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define REFUSE(name) int name() { fprintf(stderr, "fake GPU: " #name " refused (no code runs here)\n"); return 801; }
#define NOTHING(name) int name() { return 0; }
static uintptr_t last_handle = 0x1000;
static void *handle(void) { last_handle += 0x10; return (void *)last_handle; }

/* ---- device properties */
static int attribute(enum cudaDeviceAttr a) {
  switch (a) {
  case cudaDevAttrMaxThreadsPerBlock: case cudaDevAttrMaxBlockDimX: case cudaDevAttrMaxBlockDimY: return 1024;
  case cudaDevAttrMaxBlockDimZ: return 64;
  case cudaDevAttrMaxGridDimX: return 2147483647;
  case cudaDevAttrMaxGridDimY: case cudaDevAttrMaxGridDimZ: return 65535;
  case cudaDevAttrMaxSharedMemoryPerBlock: return 49152;
  case cudaDevAttrMaxSharedMemoryPerBlockOptin: return FAKE_SMEM_BLOCK_OPTIN;
  case cudaDevAttrMaxSharedMemoryPerMultiprocessor: return FAKE_SMEM_SM;
  case cudaDevAttrMaxRegistersPerBlock: case cudaDevAttrMaxRegistersPerMultiprocessor: return 65536;
  case cudaDevAttrWarpSize: return 32;
  case cudaDevAttrMultiProcessorCount: return FAKE_SMS;
  case cudaDevAttrMaxThreadsPerMultiProcessor: return FAKE_MAJOR == 8 && FAKE_MINOR == 9 ? 1536 : 2048;
  case cudaDevAttrMaxBlocksPerMultiprocessor: return 32;
  case cudaDevAttrComputeCapabilityMajor: return FAKE_MAJOR;
  case cudaDevAttrComputeCapabilityMinor: return FAKE_MINOR;
  case cudaDevAttrClockRate: return FAKE_CLOCK_KHZ;
  case cudaDevAttrMemoryClockRate: return FAKE_MEM_CLOCK_KHZ;
  case cudaDevAttrGlobalMemoryBusWidth: return FAKE_BUS_BITS;
  case cudaDevAttrL2CacheSize: return FAKE_L2;
  case cudaDevAttrConcurrentKernels: case cudaDevAttrUnifiedAddressing: case cudaDevAttrCooperativeLaunch: return 1;
  default: return 0;
  }
}
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp *p, int device) {
  memset(p, 0, sizeof *p);
  strncpy(p->name, FAKE_NAME, sizeof p->name - 1);
  p->totalGlobalMem = FAKE_MEMORY; p->major = FAKE_MAJOR; p->minor = FAKE_MINOR;
  p->multiProcessorCount = FAKE_SMS; p->warpSize = 32; p->l2CacheSize = FAKE_L2; p->memoryBusWidth = FAKE_BUS_BITS;
  p->maxThreadsPerBlock = 1024; p->maxThreadsPerMultiProcessor = attribute(cudaDevAttrMaxThreadsPerMultiProcessor);
  p->sharedMemPerBlock = 49152; p->sharedMemPerBlockOptin = FAKE_SMEM_BLOCK_OPTIN;
  p->sharedMemPerMultiprocessor = FAKE_SMEM_SM; p->regsPerBlock = p->regsPerMultiprocessor = 65536;
  p->maxThreadsDim[0] = p->maxThreadsDim[1] = 1024; p->maxThreadsDim[2] = 64;
  p->maxGridSize[0] = 2147483647; p->maxGridSize[1] = p->maxGridSize[2] = 65535; p->pciBusID = 1;
  return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int *v, enum cudaDeviceAttr a, int device) { *v = attribute(a); return cudaSuccess; }
int cuDeviceGetAttribute(int *v, int a, int device) { *v = attribute((enum cudaDeviceAttr)a); return 0; }

/* ---- runtime: one device, streams and events as handles */
cudaError_t cudaGetDeviceCount(int *n) { *n = 1; return cudaSuccess; }
cudaError_t cudaGetDevice(int *d) { *d = 0; return cudaSuccess; }
cudaError_t cudaSetDevice(int d) { return d == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaDriverGetVersion(int *v) { *v = 13000; return cudaSuccess; }
cudaError_t cudaRuntimeGetVersion(int *v) { *v = 13000; return cudaSuccess; }
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total) {
  *free_bytes = *total = FAKE_MEMORY; return cudaSuccess; }
cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest) {
  *least = 0; *greatest = -5; return cudaSuccess; }
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned f, int p) { *s = handle(); return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned f) { *s = handle(); return cudaSuccess; }
cudaError_t cudaStreamGetPriority(cudaStream_t s, int *p) { *p = 0; return cudaSuccess; }
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *status) {
  *status = cudaStreamCaptureStatusNone; return cudaSuccess; }
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, enum cudaStreamCaptureStatus *status, unsigned long long *id,
                                     void *graph, void *deps, void *edges, size_t *n) {
  *status = cudaStreamCaptureStatusNone; if (id) *id = 0; if (n) *n = 0; return cudaSuccess; }
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *mode) { return cudaSuccess; }
cudaError_t cudaEventCreate(cudaEvent_t *e) { *e = handle(); return cudaSuccess; }
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned f) { *e = handle(); return cudaSuccess; }
NOTHING(cudaGetLastError) NOTHING(cudaPeekAtLastError) NOTHING(cudaDeviceSynchronize) NOTHING(cudaEventDestroy)
NOTHING(cudaEventRecord) NOTHING(cudaEventRecordWithFlags) NOTHING(cudaEventSynchronize) NOTHING(cudaEventQuery)
NOTHING(cudaStreamSynchronize) NOTHING(cudaStreamQuery) NOTHING(cudaStreamWaitEvent)

/* ---- memory: host memory, capped; copies and fills are memcpy and memset. Only Inductor's own small
   tensors land here: a model, a batch or an activation arriving means something ran outside fake tensors. */
#define HOST_CAP (64u << 20)
static size_t host_bytes = 0;
cudaError_t cudaMalloc(void **p, size_t n) {
  if (host_bytes + n > HOST_CAP) {
    fprintf(stderr, "fake GPU: a real allocation of %zu bytes refused: only fake tensors belong on this GPU\n", n);
    return cudaErrorMemoryAllocation;
  }
  host_bytes += n;
  return posix_memalign(p, 512, n ? n : 1) ? cudaErrorMemoryAllocation : cudaSuccess;
}
cudaError_t cudaFree(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned f) { return cudaMalloc(p, n); }
cudaError_t cudaFreeHost(void *p) { free(p); return cudaSuccess; }
cudaError_t cudaMemcpy(void *d, const void *s, size_t n, enum cudaMemcpyKind k) { memcpy(d, s, n); return cudaSuccess; }
cudaError_t cudaMemcpyAsync(void *d, const void *s, size_t n, enum cudaMemcpyKind k, cudaStream_t st) {
  memcpy(d, s, n); return cudaSuccess; }
cudaError_t cudaMemset(void *d, int v, size_t n) { memset(d, v, n); return cudaSuccess; }
cudaError_t cudaMemsetAsync(void *d, int v, size_t n, cudaStream_t st) { memset(d, v, n); return cudaSuccess; }

/* ---- driver: a current context, and modules that are checked and counted but never run */
static int cubins = 0, foreign = 0;
int fake_gpu_cubins(void) { return cubins; }
int fake_gpu_foreign_cubins(void) { return foreign; }
static int check_cubin(const unsigned char *image) {
  if (memcmp(image, "\x7f" "ELF", 4) != 0) { fprintf(stderr, "fake GPU: a module that is not a cubin\n"); return 200; }
  unsigned flags = *(const unsigned *)(image + 48);  /* e_flags: the SM version in the low byte */
  if ((flags & 0xff) != FAKE_MAJOR * 10 + FAKE_MINOR) foreign++;
  cubins++;
  return 0;
}
int cuModuleLoadData(void **m, const void *image) { *m = handle(); return check_cubin(image); }
int cuModuleLoadDataEx(void **m, const void *image, unsigned n, void *o, void **v) {
  *m = handle(); return check_cubin(image); }
int cuModuleLoad(void **m, const char *path) {
  unsigned char head[64] = {0};
  FILE *f = fopen(path, "rb");
  if (!f) return 301;
  size_t got = fread(head, 1, sizeof head, f);
  fclose(f);
  *m = handle();
  return got == sizeof head ? check_cubin(head) : 200;
}
int cuModuleGetFunction(void **fn, void *m, const char *name) { *fn = handle(); return 0; }
int cuFuncGetAttribute(int *v, int attr, void *fn) { *v = attr == 0 ? 1024 : attr == 4 ? 64 : 0; return 0; }
int cuInit(unsigned f) { return 0; }
int cuDriverGetVersion(int *v) { *v = 13000; return 0; }
int cuDeviceGetCount(int *n) { *n = 1; return 0; }
int cuDeviceGet(int *d, int ordinal) { *d = 0; return 0; }
int cuCtxGetCurrent(void **c) { *c = (void *)0x1; return 0; }
int cuCtxGetDevice(int *d) { *d = 0; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)0x1; return 0; }
int cuDevicePrimaryCtxGetState(int d, unsigned *flags, int *active) { *flags = 0; *active = 1; return 0; }
int cuCtxGetLimit(size_t *v, int limit) { *v = 0; return 0; }
int cuGetErrorName(int e, const char **s) { *s = "CUDA_ERROR_FAKE_GPU"; return 0; }
int cuGetErrorString(int e, const char **s) { *s = "the fake GPU runs no code"; return 0; }
NOTHING(cuCtxSetCurrent) NOTHING(cuCtxSetLimit) NOTHING(cuModuleUnload) NOTHING(cuFuncSetAttribute)
NOTHING(cuFuncSetCacheConfig)

/* ---- everything that would run code, move data between devices or capture a graph */
REFUSE(cudaLaunchKernel) REFUSE(cudaLaunchKernelExC) REFUSE(cudaLaunchCooperativeKernel) REFUSE(cudaLaunchHostFunc)
REFUSE(cudaGraphLaunch) REFUSE(cudaStreamBeginCapture) REFUSE(cudaStreamBeginCaptureToGraph)
REFUSE(cudaStreamEndCapture) REFUSE(cudaGraphInstantiateWithFlags) REFUSE(cudaMallocAsync) REFUSE(cudaFreeAsync)
REFUSE(cudaMemcpy2DAsync) REFUSE(cudaMemcpyPeerAsync) REFUSE(cudaMemcpyToSymbol)
REFUSE(cudaGetDriverEntryPointByVersion) REFUSE(cudaDeviceCanAccessPeer) REFUSE(cudaDeviceEnablePeerAccess)
REFUSE(cudaIpcGetMemHandle) REFUSE(cudaIpcOpenMemHandle)
REFUSE(cudaLibraryLoadData) REFUSE(cudaLibraryGetKernel) REFUSE(cudaFuncGetAttributes) REFUSE(cudaFuncSetAttribute)
REFUSE(cudaPointerGetAttributes) REFUSE(cudaHostRegister) REFUSE(cudaDeviceGetPCIBusId)
REFUSE(cuLaunchKernel) REFUSE(cuLaunchKernelEx) REFUSE(cuLaunchCooperativeKernel)
REFUSE(cuLinkCreate_v2) REFUSE(cuLinkAddData_v2) REFUSE(cuLinkComplete) REFUSE(cuPointerGetAttribute)
REFUSE(cuPointerGetAttributes) REFUSE(cuOccupancyMaxActiveBlocksPerMultiprocessor) REFUSE(cuOccupancyMaxActiveClusters)
REFUSE(cuTensorMapEncodeTiled) REFUSE(cuTensorMapEncodeIm2col)
"""


def shim_library(gpu: FakeGPU) -> str:
    """The fake runtime and driver built for gpu, as <cache>/<hash>/libcuda.so.1 (built once; gcc, and the
    CUDA headers Triton ships)."""
    import triton
    include = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "include")
    defines = {f"FAKE_{k.upper()}": (json.dumps(v) if isinstance(v, str) else f"{v}L" if k == "memory" else v)
               for k, v in vars(gpu).items()}
    key = hashlib.sha256((SHIM + repr(sorted(defines.items())) + include).encode()).hexdigest()[:16]
    folder = os.path.join(os.path.expanduser("~"), ".cache", "modern-llm", "fake_gpu", key)
    path = os.path.join(folder, "libcuda.so.1")  # Triton links its launcher against libcuda.so.1: this one
    if not os.path.isfile(path):
        os.makedirs(folder, exist_ok=True)
        source = os.path.join(folder, "fake_gpu.c")
        with open(source, "w", encoding="utf-8") as f:
            f.write(SHIM)
        flags = [f"-D{k}={v}" for k, v in defines.items()]
        tmp = path + f".{os.getpid()}"
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-w", f"-I{include}", *flags, source, "-o", tmp,
                        "-Wl,-soname,libcuda.so.1"], check=True, capture_output=True, text=True)
        os.replace(tmp, path)  # another check building the same library at once finds it whole
    return path


def fake_gpu_env(library: str, cache: str) -> dict:
    """The environment of a process that sees the fake GPU, with compile caches of its own (nothing reused
    from an earlier run: every kernel compiles)."""
    env = dict(os.environ, LD_PRELOAD=library, TRITON_LIBCUDA_PATH=os.path.dirname(library),
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"),
               TRITON_CACHE_DIR=os.path.join(cache, "triton"), CUDA_VISIBLE_DEVICES="0")
    env.pop("PYTORCH_NVML_BASED_CUDA_CHECK", None)  # NVML would look for a real GPU
    return env
