// Small device helpers shared by the tieredkv kernels (framework-free: CUDA runtime only).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <utility>

namespace tieredkv {
namespace kernels {

constexpr int kWarpSize = 32;
//! Largest head dim the kernels accept: each lane of a warp holds D / 32 values in registers.
constexpr int kMaxHeadDim = 256;
constexpr int kMaxPerLane = kMaxHeadDim / kWarpSize;

//! Sum of `x` over the 32 lanes of a warp; every lane gets the total.
__device__ __forceinline__ float warp_sum(float x) {
    for (int delta = kWarpSize / 2; delta > 0; delta /= 2) {
        x += __shfl_xor_sync(0xffffffffu, x, delta);
    }
    return x;
}

//! Dot product of the lane's slice of `a` (registers, element i <-> dim lane + 32 * i) with
//! `b[0..D)` in global memory; every lane gets the result.
__device__ __forceinline__ float warp_dot(const float (&a)[kMaxPerLane], const float* __restrict__ b, int D,
                                          int lane) {
    float partial = 0.f;
#pragma unroll
    for (int i = 0; i < kMaxPerLane; ++i) {
        const int d = lane + kWarpSize * i;
        if (d < D) partial += a[i] * b[d];
    }
    return warp_sum(partial);
}

//! Merge two (max, sum of exp(x - max)) pairs of an online softmax; -inf max means empty.
__device__ __forceinline__ void softmax_merge(float& m, float& s, float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) {
        m = m2;
        s = s2;
        return;
    }
    const float mx = fmaxf(m, m2);
    s = s * expf(m - mx) + s2 * expf(m2 - mx);
    m = mx;
}

//! Merge every warp's running (max, denominator) of an online softmax into the block's and
//! return it to all threads. Lane 0 of each warp contributes its pair; every thread of the
//! block must call it (it synchronizes twice), at most once per kernel invocation.
template <int kWarps>
__device__ __forceinline__ void block_softmax_stats(float run_max, float run_den, int warp, int lane, float& mx,
                                                    float& den) {
    __shared__ float warp_max[kWarps];
    __shared__ float warp_den[kWarps];
    __shared__ float block_stats[2];
    if (lane == 0) {
        warp_max[warp] = run_max;
        warp_den[warp] = run_den;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = -INFINITY;
        float s = 0.f;
        for (int w = 0; w < kWarps; ++w) softmax_merge(m, s, warp_max[w], warp_den[w]);
        block_stats[0] = m;
        block_stats[1] = s;
    }
    __syncthreads();
    mx = block_stats[0];
    den = block_stats[1];
}

//! Programmatic dependent launch (sm_90): wait for the grid this one depends on (its writes
//! visible), and let the grid that depends on this one be scheduled. Both no-ops without it.
__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependent_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

constexpr int kMaxDevices = 64;

//! The current device, or -1 when the runtime cannot say.
inline int current_device() {
    int device = 0;
    return cudaGetDevice(&device) == cudaSuccess ? device : -1;
}

//! A device attribute of the current device (cached per device); 0 when the runtime cannot say.
template <cudaDeviceAttr kAttr>
inline int device_attribute() {
    static std::atomic<int> cache[kMaxDevices];
    const int device = current_device();
    if (device < 0) return 0;
    if (device < kMaxDevices) {
        const int known = cache[device].load(std::memory_order_relaxed);
        if (known > 0) return known;
    }
    int value = 0;
    if (cudaDeviceGetAttribute(&value, kAttr, device) != cudaSuccess) return 0;
    if (device < kMaxDevices) cache[device].store(value, std::memory_order_relaxed);
    return value;
}

inline int current_sm_count() { return device_attribute<cudaDevAttrMultiProcessorCount>(); }

//! Launches `kernel` on `grid` blocks of `threads`; as a programmatic dependent launch on sm_90 and
//! later, so the kernel must start with wait_prior_grid (its launch then overlaps the previous
//! kernel's end).
template <typename... Params, typename... Args>
inline cudaError_t launch_kernel(void (*kernel)(Params...), unsigned int grid, unsigned int threads, size_t smem,
                                 cudaStream_t stream, Args&&... args) {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(grid);
    config.blockDim = dim3(threads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attribute[0].val.programmaticStreamSerializationAllowed = 1;
    config.attrs = attribute;
    config.numAttrs = device_attribute<cudaDevAttrComputeCapabilityMajor>() >= 9 ? 1 : 0;
    return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

//! Number of blocks of `threads` covering `n` items, capped for a grid-stride loop.
inline unsigned int grid_for(int64_t n, int threads) {
    const int64_t blocks = (n + threads - 1) / threads;
    return static_cast<unsigned int>(blocks < 65535 ? blocks : 65535);
}

}  // namespace kernels
}  // namespace tieredkv
