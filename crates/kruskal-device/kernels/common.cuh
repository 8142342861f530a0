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
