// Host-side check of store_ld_mma_row (flash_bwd_common.cuh), compiled and run by tests/test_ld_mma_row.py: the
// three bf16 values of a row add up to x within 2^-23 of |x| (the matmul sums them in fp32), the row's other five
// values are zeros, and an infinite x keeps its sign in the first value with zeros after it (a row that sees no key
// has L = +inf).
#include <cmath>
#include <cstdio>
#include <limits>

#include "host_check.h"
#include "flash_bwd_common.cuh"

int main() {
    const float inf = std::numeric_limits<float>::infinity();
    const float xs[] = {0.f, 1.f, -1.f, 3.14159265f, -2.718281828f, 1e-8f, -123456.789f, 0.1f, 7.3e5f, -5.9e-3f, inf, -inf};
    const char* name = "ld_mma_row";
    float worst = 0.f;
    for (float x : xs) {
        __nv_bfloat16 row[8];
        flash::store_ld_mma_row(row, x);
        float v[8];
        for (int i = 0; i < 8; ++i) v[i] = __bfloat162float(row[i]);
        for (int i = 3; i < 8; ++i) HOST_CHECK(name, v[i] == 0.f, "x = %g: element %d is %g", x, i, v[i]);
        if (std::isinf(x)) {
            HOST_CHECK(name, v[0] == x && v[1] == 0.f && v[2] == 0.f, "x = %g: %g %g %g", x, v[0], v[1], v[2]);
            continue;
        }
        const double sum = static_cast<double>(v[0]) + v[1] + v[2];
        const double err = std::fabs(sum - x);
        HOST_CHECK(name, err <= std::ldexp(std::fabs(static_cast<double>(x)), -23), "x = %.9g: sum %.12g, error %g", x,
                   sum, err);
        if (x != 0.f) worst = std::fmax(worst, static_cast<float>(err / std::fabs(x)));
    }
    if (g_failures == 0) std::printf("ok %s\n", name);
    std::printf("worst relative error %.3g\n", worst);
    return g_failures == 0 ? 0 : 1;
}
