// The kernels for AVX2 + FMA + F16C (x86-64-v3), chosen at run time where the CPU has them.
#include "kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,lzcnt,movbe")
#define CORRAL_VARIANT avx2
#define CORRAL_VARIANT_NAME "avx2"
#define CORRAL_VECTOR_BYTES 32  // the target pragma defines no __AVX*__ macro under g++
#include "kernels_impl.h"
#endif
