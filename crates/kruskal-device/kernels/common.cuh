// Shared definitions of kruskal's MTTKRP kernels.
//
// Every kernel is compiled at run time by NVRTC with
//   -DNMODES=<modes> -DRANK=<rank>
// (and kernel-specific launch-shape defines), so loops over modes and rank
// columns have compile-time bounds. RANK need not be a multiple of 32.

#pragma once

// Files whose kernels do not depend on the mode count define RANK_ONLY
// before including this header.
#if !defined(NMODES) && !defined(RANK_ONLY)
#error "NMODES must be defined (-DNMODES=...)"
#endif
#ifndef RANK
#error "RANK must be defined (-DRANK=...)"
#endif

typedef unsigned int u32;
typedef unsigned long long u64;

#define WARP 32

// Rank columns one lane handles: lane, lane + 32, ...
#define COLS_PER_LANE ((RANK + WARP - 1) / WARP)

// Lane teams (-DTEAMS=1, the fcoo and shard kernels): TL = RANK / 4 lanes
// hold one nonzero's row as float4s, NT = 32 / TL teams per warp. Nothing
// is defined without -DTEAMS (mttkrp_flycoo.cu has TEAMS and TL of its own).
#if defined(TEAMS) && TEAMS
#if RANK != 16 && RANK != 32 && RANK != 64 && RANK != 128
#error "TEAMS needs RANK 16, 32, 64 or 128"
#endif
#define TL (RANK / 4)
#define NT (WARP / TL)
#endif

// f64 tensor cores (sm_80 and later): D = A B + D for one m8n8k4 MMA of a
// warp, a = A(g, q), b = B(q, g), d = D(g, 2q .. 2q + 1) of lane 4 g + q
// (dense.cu's cpd_update and Gram, admm.cu's admm_blocks).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
__device__ __forceinline__ void mma_884(double (&d)[2], double a, double b)
{
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0, %1}, {%2}, {%3}, {%0, %1};"
                 : "+d"(d[0]), "+d"(d[1])
                 : "d"(a), "d"(b));
}
#endif
