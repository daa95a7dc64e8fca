// QTX_HD marks functions that compile for both the host and CUDA devices, so
// that kernels/cpu and kernels/cuda share one copy of the arithmetic.
#ifndef QTX_KERNELS_HOST_DEVICE_H_
#define QTX_KERNELS_HOST_DEVICE_H_

#if defined(__CUDACC__)
#define QTX_HD __host__ __device__ __forceinline__
#else
#define QTX_HD inline
#endif

#endif  // QTX_KERNELS_HOST_DEVICE_H_
