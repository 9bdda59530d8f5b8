// Turn runtime dtype / head dim / causal flags into compile-time constants, in one place.
// (Pattern from flash-attention's static_switch.h.) Each macro defines a constexpr in the branch scope
// and runs the lambda-like body once per instantiation.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

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

// The instantiated head dims; any other multiple of 8 runs the next larger one with the extra
// columns zero-filled on load and skipped on store (flash::round_head_dim gives the choice).
#define FLASH_HEADDIM_SWITCH(HEADDIM, CONST_NAME, ...) \
    [&] {                                             \
        if (HEADDIM <= 32) {                          \
            constexpr static int CONST_NAME = 32;     \
            return __VA_ARGS__();                     \
        } else if (HEADDIM <= 64) {                   \
            constexpr static int CONST_NAME = 64;     \
            return __VA_ARGS__();                     \
        } else if (HEADDIM <= 96) {                   \
            constexpr static int CONST_NAME = 96;     \
            return __VA_ARGS__();                     \
        } else if (HEADDIM <= 128) {                  \
            constexpr static int CONST_NAME = 128;    \
            return __VA_ARGS__();                     \
        } else {                                      \
            constexpr static int CONST_NAME = 256;    \
            return __VA_ARGS__();                     \
        }                                             \
    }()
