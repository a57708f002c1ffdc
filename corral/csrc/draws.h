// The sampling parameters of a native draw (sample_pick's, and a sampled burst's), read from Python lists and
// checked once, in float32 as the torch path has them.
#pragma once

#include "common.h"
#include "kernels.h"

#include <vector>

namespace corral_native {

struct DrawLists {
    std::vector<float> temperature, top_p, min_p;
    std::vector<int64_t> top_k;
    std::vector<double> uniform;  // `steps` uniforms per row, step-major: step s's at [s * rows, (s + 1) * rows)

    // temperature, top_k, top_p, min_p: lists of one number per row (temperature 0: greedy; top_k 0, top_p 1,
    // min_p 0: off); uniform: a list of rows * steps numbers in [0, 1). `who` names the caller in errors.
    DrawLists(nb::handle temperature_in, nb::handle top_k_in, nb::handle top_p_in, nb::handle min_p_in,
              nb::handle uniform_in, int64_t rows, int64_t steps, const char* who);

    // The parameters of step `step`'s draws.
    corral_kernels::DrawParams params(int64_t step, const corral_kernels::RowShaping* shaping = nullptr) const {
        const int64_t rows = int64_t(temperature.size());
        return {temperature.data(), top_k.data(), top_p.data(), min_p.data(), uniform.data() + step * rows, shaping};
    }
};

}  // namespace corral_native
