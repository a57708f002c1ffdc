// The kernels for the build's baseline instruction set (x86-64-v2 on x86; whatever the compiler targets elsewhere).
#include "kernels.h"

#define CORRAL_VARIANT baseline
#define CORRAL_VARIANT_NAME "baseline"
#include "kernels_impl.h"
