// Prompt attention for a block of queries, the queries along a vector's lanes
// (paged_attention_cpu.cpp, float32 caches with a compile-time head size).
//
// The per-token kernel gives each query token its own walk over the keys: every
// score is a dot product summed across a vector's lanes, and every softmax
// step (running max, rescale) is scalar work per query and head. A prompt's
// queries all walk the same keys, so here up to W of them (W = a vector's
// float32 lanes) walk together for one head: the block's queries, transposed
// once (qt[d] holds dimension d of every query), are multiplied by each key's
// scalar k[d] broadcast, so a key's scores for the whole block come out as one
// vector with no horizontal sum; the running max, the rescale and exp are
// vector operations over the block; the weighted sum adds each V row, scaled
// by the key's vector of weights, into accumulators held per dimension. The
// same online softmax over tiles of TILE keys from position 0 as the per-token
// kernel, in float32 throughout: a query's result does not depend on the other
// queries in its block (lanes never mix; a key a query may not see, past its
// own position, gets weight exactly 0, and a tile with no key it may see leaves
// its sums exactly as they were). Its summation order differs from the
// per-token kernel's, so the two agree to float32 rounding, not bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "simd_passes.h"

namespace minibatch_simd {

// Per-thread scratch for attend_query_block: DC x W floats each for the transposed
// queries and the accumulators, tile x W for the scores.
struct QueryBlockScratch {
  float* qt;
  float* acc;
  float* score;
  int64_t* slot;
};

// One block: queries t0 .. t0 + nq - 1 (nq <= W) of one sequence, at absolute positions
// first_pos .. first_pos + nq - 1, head h of Hq (KV head kv_head); keys 0 .. first_pos + nq - 1.
// q rows have stride q_stride (head h at h * DC); out rows Hq * DC. fill_slots(start, n,
// slot) gives key positions start .. start + n - 1's rows in k and v (rows k_row, v_row
// apart; the KV head at kv_head * DC within a row). scale multiplies the queries.
template <int64_t DC, int64_t TILE, typename FillSlots>
inline void attend_query_block(float* out, int64_t Hq, const float* q, int64_t q_stride, int64_t t0, int64_t nq,
                               int64_t first_pos, int64_t h, int64_t kv_head, const float* k, int64_t k_row,
                               const float* v, int64_t v_row, float scale, FillSlots&& fill_slots,
                               QueryBlockScratch buf) {
  using vec = typename Simd<float>::vec;
  typedef int32_t ivec __attribute__((vector_size(VEC_BYTES)));
  constexpr int64_t W = Simd<float>::width;
  constexpr int64_t J = 8;                  // keys scored at once: J independent chains of FMAs
  constexpr int64_t DCH = DC < 16 ? DC : 16;   // accumulator rows held in registers at once
  static_assert(TILE % J == 0 && DC % DCH == 0, "tile and head size must split evenly");
  vec* qt = reinterpret_cast<vec*>(buf.qt);
  vec* acc = reinterpret_cast<vec*>(buf.acc);
  vec* score = reinterpret_cast<vec*>(buf.score);
  const float lowest = std::numeric_limits<float>::lowest();

  // the block's queries, transposed and scaled (lanes past nq stay zero)
  for (int64_t d = 0; d < DC; ++d) qt[d] = vec{} + 0.0f;
  for (int64_t i = 0; i < nq; ++i) {
    const float* src = q + (t0 + i) * q_stride + h * DC;
    for (int64_t d = 0; d < DC; ++d) buf.qt[d * W + i] = src[d] * scale;
  }
  for (int64_t d = 0; d < DC; ++d) acc[d] = vec{} + 0.0f;
  ivec qpos;
  for (int64_t i = 0; i < W; ++i) qpos[i] = static_cast<int32_t>(first_pos + i);
  vec m = vec{} + lowest, l = vec{} + 0.0f;
  const int64_t num_keys = first_pos + nq;   // the last query's keys: 0 .. its position
  int64_t* slot = buf.slot;

  for (int64_t start = 0; start < num_keys; start += TILE) {
    const int64_t n = std::min(TILE, num_keys - start), padded = (n + J - 1) / J * J;
    fill_slots(start, n, slot);
    for (int64_t j = n; j < padded; ++j) slot[j] = slot[0];   // read a real row; masked below
    // scores: J keys at a time, each K value broadcast against the block's queries
    for (int64_t j0 = 0; j0 < padded; j0 += J) {
      const float* kr[J];
      for (int64_t j = 0; j < J; ++j) kr[j] = k + slot[j0 + j] * k_row + kv_head * DC;
      vec s[J];
      for (int64_t j = 0; j < J; ++j) s[j] = qt[0] * kr[j][0];
      for (int64_t d = 1; d < DC; ++d) {
        const vec qd = qt[d];
        for (int64_t j = 0; j < J; ++j) s[j] += qd * kr[j][d];
      }
      for (int64_t j = 0; j < J; ++j) score[j0 + j] = s[j];
    }
    // the causal mask (a key past a query's position), the tile's max, the rescale
    vec tile_max = vec{} + lowest;
    for (int64_t j = 0; j < padded; ++j) {
      const ivec seen = qpos >= static_cast<int32_t>(start + j);
      score[j] = seen ? score[j] : lowest;
      tile_max = tile_max > score[j] ? tile_max : score[j];
    }
    const vec m_new = m > tile_max ? m : tile_max;
    alignas(64) float mn[W], al[W];
    std::memcpy(mn, &m_new, sizeof mn);
    if (start == 0) {
      std::fill(al, al + W, 0.0f);
    } else {
      std::memcpy(al, &m, sizeof al);
#pragma omp simd
      for (int64_t i = 0; i < W; ++i) al[i] = std::exp(al[i] - mn[i]);
    }
    vec alpha;
    std::memcpy(&alpha, al, sizeof alpha);
    if (start > 0) alpha = m_new == m ? vec{} + 1.0f : alpha;   // nothing new seen: the sums stay exactly
    for (int64_t j = 0; j < padded; ++j) {   // masked keys get 0 here (finite), weight 0 below
      const ivec seen = qpos >= static_cast<int32_t>(start + j);
      score[j] = seen ? score[j] - m_new : vec{} + 0.0f;
    }
    float* sc = buf.score;
#pragma omp simd
    for (int64_t i = 0; i < padded * W; ++i) sc[i] = std::exp(sc[i]);
    vec sum = vec{} + 0.0f;
    for (int64_t j = 0; j < padded; ++j) {
      const ivec seen = qpos >= static_cast<int32_t>(start + j);
      score[j] = seen ? score[j] : vec{} + 0.0f;
      sum += score[j];
    }
    l = l * alpha + sum;
    m = m_new;
    // the weighted sum: DCH accumulator rows in registers while the tile's V rows stream past
    for (int64_t d0 = 0; d0 < DC; d0 += DCH) {
      vec a[DCH];
      for (int64_t d = 0; d < DCH; ++d) a[d] = acc[d0 + d] * alpha;
      for (int64_t j = 0; j < n; ++j) {
        const float* vr = v + slot[j] * v_row + kv_head * DC + d0;
        const vec p = score[j];
        for (int64_t d = 0; d < DCH; ++d) a[d] += p * vr[d];
      }
      for (int64_t d = 0; d < DCH; ++d) acc[d0 + d] = a[d];
    }
  }
  const vec inv = (vec{} + 1.0f) / l;
  for (int64_t d = 0; d < DC; ++d) {
    const vec o = acc[d] * inv;
    for (int64_t i = 0; i < nq; ++i) out[(t0 + i) * Hq * DC + h * DC + d] = o[i];
  }
}

}  // namespace minibatch_simd
