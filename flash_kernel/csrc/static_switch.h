// Turn runtime dtype / head dim / causal flags into compile-time constants, in one place.
// (Pattern from flash-attention's static_switch.h.) Each macro defines a constexpr in the branch scope
// and runs the lambda-like body once per instantiation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>
#include <utility>

#include "kernel_traits.h"  // kHeadDims

#define FLASH_BOOL_SWITCH(COND, CONST_NAME, ...) \
    [&] {                                        \
        if (COND) {                              \
            constexpr static bool CONST_NAME = true; \
            return __VA_ARGS__();                \
        } else {                                 \
            constexpr static bool CONST_NAME = false; \
            return __VA_ARGS__();                \
        }                                        \
    }()

#define FLASH_DTYPE_SWITCH(IS_BF16, ELEMENT, ...) \
    [&] {                                        \
        if (IS_BF16) {                           \
            using ELEMENT = __nv_bfloat16;       \
            return __VA_ARGS__();                \
        } else {                                 \
            using ELEMENT = __half;              \
            return __VA_ARGS__();                \
        }                                        \
    }()

namespace flash {

// f(std::integral_constant<int, D>{}) for D = round_head_dim(d), the first of kHeadDims from index I on that is
// >= d (the last one for any larger d).
template <int I = 0, typename F>
decltype(auto) head_dim_switch(int d, F&& f) {
    constexpr int kHeadDim = kHeadDims[I];
    if constexpr (I + 1 == kNumHeadDims) {
        return f(std::integral_constant<int, kHeadDim>{});
    } else {
        if (d <= kHeadDim) return f(std::integral_constant<int, kHeadDim>{});
        return head_dim_switch<I + 1>(d, std::forward<F>(f));
    }
}

}  // namespace flash

// The instantiated head dims (kHeadDims, kernel_traits.h): HEADDIM runs round_head_dim(HEADDIM).
#define FLASH_HEADDIM_SWITCH(HEADDIM, CONST_NAME, ...)                        \
    flash::head_dim_switch(HEADDIM, [&](auto flash_head_dim_) {               \
        constexpr static int CONST_NAME = decltype(flash_head_dim_)::value;   \
        return __VA_ARGS__();                                                 \
    })
