// Host-check stand-in for the CUDA runtime header (csrc/host_check/README.md): the few names that
// flashtx_cuda.h and binding.cpp use, so the binding builds with -DFTX_HOST_CHECK where no CUDA toolkit
// is installed. Never on the include path of a real build.
#pragma once

typedef struct CUstream_st* cudaStream_t;
typedef enum cudaError { cudaSuccess = 0, cudaErrorInvalidValue = 1, cudaErrorInvalidConfiguration = 9 } cudaError_t;

#ifdef __cplusplus
extern "C" {
#endif
const char* cudaGetErrorString(cudaError_t error);
#ifdef __cplusplus
}
#endif
