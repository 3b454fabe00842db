/*
 * The instruction set a library build targets. The kernel sources are compiled once per level,
 * each build with its own flags (kernels/cpu/__init__.py: portable, avx2, avx512), and Python
 * loads the best build the CPU runs, capped by RADIXRT_CPU_ISA. A kernel `foo` has a plain-C
 * twin `foo_portable` in every build (the reference its SIMD versions are tested against) and
 * SIMD versions in files of their own (`*_avx2.c`, `*_avx512.c`) compiled to nothing in builds
 * whose level is lower.
 */
#ifndef RADIXRT_CPU_ISA_H
#define RADIXRT_CPU_ISA_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__) && \
    defined(__AVX512VNNI__)
#define RADIXRT_ISA_AVX512 1
#else
#define RADIXRT_ISA_AVX512 0
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXRT_ISA_AVX2 1
#else
#define RADIXRT_ISA_AVX2 0
#endif

/* 0 portable, 1 avx2, 2 avx512: what radixrt_isa_level() reports for the loaded build */
#define RADIXRT_ISA_LEVEL (RADIXRT_ISA_AVX512 ? 2 : RADIXRT_ISA_AVX2 ? 1 : 0)

#endif
