// The kernels for AVX-512 (F, BW, VL, DQ; x86-64-v4), chosen at run time where the CPU has them: attention's
// dot products and weighted sums over 64-wide heads are 4 vector operations here where AVX2 takes 8.
#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2,lzcnt,movbe")
#define CORRAL_VARIANT avx512
#define CORRAL_VARIANT_NAME "avx512"
#define CORRAL_VECTOR_BYTES 64  // the target pragma defines no __AVX*__ macro under g++
#include "kernels_impl.h"
#endif
