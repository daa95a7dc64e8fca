// The band kernel of kernels/cpu/adamw_band.cc compiled with -march=x86-64-v4
// (AVX-512 F/BW/CD/DQ/VL) into namespace band::avx512; adamw.cc runs it when
// the CPU has AVX-512 (see adamw_band.h).
#define QTX_ADAMW_BAND_AVX512 1
#include "kernels/cpu/adamw_band.cc"  // NOLINT(bugprone-suspicious-include)
