// What the host checks (tests/*_check.cu, compiled for the CPU by tests/conftest.py's host_check) share: a failure
// count that main returns on, and HOST_CHECK, which prints the first ten failures with where they happened.
#pragma once

#include <cstdio>

static int g_failures = 0;
#define HOST_CHECK(where, cond, ...)                \
    do {                                            \
        if (!(cond)) {                              \
            if (g_failures++ < 10) {                \
                std::printf("FAIL %s: ", where);    \
                std::printf(__VA_ARGS__);           \
                std::printf("\n");                  \
            }                                       \
        }                                           \
    } while (0)
