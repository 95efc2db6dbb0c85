// Explicit-SIMD passes for the CPU paged-attention kernel (paged_attention_cpu.cpp).
//
// For float32, float64 and bfloat16 caches with a compile-time head size, each tile of keys is
// walked in passes of a few heads: the pass's query rows (scores_pass), then its
// accumulator rows (weighted_sum_pass), stay in vector registers while the tile's K,
// then V, rows stream past. Left to itself, the compiler kept the accumulators in
// memory and summed each dot product's lanes one by one (and, with the loops
// reordered, vectorised the loop over keys, with gathers). The vectors are GCC/Clang
// vector types, not intrinsics. The arithmetic is the plain loops' (the kernel's
// scores_plain and weighted_sum_plain): only the summation order within a dot
// product differs. A bfloat16 cache is read as float32 vectors (a bfloat16 is the
// high half of a float32), and the arithmetic is float32's.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include <c10/util/BFloat16.h>

namespace minibatch_simd {

#if defined(__AVX512F__)
constexpr int VEC_BYTES = 64, VEC_REGS = 32;   // one zmm register per vector
#else
constexpr int VEC_BYTES = 32, VEC_REGS = 16;   // AVX2 ymm (elsewhere the compiler splits them)
#endif

template <typename T>
struct Simd {
  typedef T vec __attribute__((vector_size(VEC_BYTES), aligned(sizeof(T))));   // unaligned loads allowed
  typedef T vec16 __attribute__((vector_size(16), aligned(sizeof(T))));   // a 16-byte piece
  static constexpr int64_t width = VEC_BYTES / sizeof(T);
  // heads per pass: their query (or accumulator) rows fill half the vector registers
  template <int64_t DC>
  static constexpr int64_t heads_per_pass =
      std::max<int64_t>(1, VEC_REGS / 2 / std::max<int64_t>(1, DC / width));
};

// One vector of T from storage of type S at p: the bytes themselves, or, for a
// bfloat16 cache read in float32, each 16-bit value shifted into a float's high half.
template <typename T, typename S>
inline typename Simd<T>::vec load_vec(const S* p) {
  using vec = typename Simd<T>::vec;
  if constexpr (std::is_same_v<S, T>) {
    return *reinterpret_cast<const vec*>(p);
  } else {
    static_assert(std::is_same_v<T, float> && std::is_same_v<S, c10::BFloat16>, "float32 from bfloat16 only");
    typedef uint16_t half_bits __attribute__((vector_size(VEC_BYTES / 2), aligned(2)));
    typedef uint32_t word_bits __attribute__((vector_size(VEC_BYTES), aligned(4)));
    half_bits h;
    std::memcpy(&h, p, sizeof(h));
    const word_bits w = __builtin_convertvector(h, word_bits) << 16;
    vec f;
    std::memcpy(&f, &w, sizeof(f));
    return f;
  }
}

// the sum of a vector's lanes: its 16-byte pieces folded into one with vector adds,
// then 4 (float32) or 2 (float64) scalar adds
template <typename T>
inline T lane_sum(const typename Simd<T>::vec& v) {
  typename Simd<T>::vec16 acc, part;
  std::memcpy(&acc, &v, 16);
  for (int b = 16; b < VEC_BYTES; b += 16) {
    std::memcpy(&part, reinterpret_cast<const char*>(&v) + b, 16);
    acc += part;
  }
  T s = 0;
  for (int l = 0; l < int(16 / sizeof(T)); ++l) s += acc[l];
  return s;
}

// A pass's registers: the rows of heads h0 .. h0 + NH - 1 (of a [Hq, DC] array),
// and where each head's KV head starts in a K or V row.
template <int64_t DC, int64_t NH, typename T>
inline void load_pass(typename Simd<T>::vec (&rows)[NH][DC / Simd<T>::width],
                      int64_t (&kv_offset)[NH], const T* src, int64_t h0, int64_t G) {
  using vec = typename Simd<T>::vec;
  for (int64_t h = 0; h < NH; ++h) {
    kv_offset[h] = ((h0 + h) / G) * DC;
    for (int64_t i = 0; i < DC / Simd<T>::width; ++i)
      rows[h][i] = reinterpret_cast<const vec*>(src + (h0 + h) * DC)[i];
  }
}

// One pass over a tile of n keys for the NH heads h0 .. h0 + NH - 1, their queries in
// registers: score[h * tile + j] = q[h] . K[slot[j]][h / G]. Each K row is read once per pass.
template <int64_t DC, int64_t NH, typename T, typename S>
inline void scores_pass(T* score, int64_t tile, const T* q, const S* k, int64_t k_row, const int64_t* slot,
                        int64_t n, int64_t h0, int64_t G) {
  using vec = typename Simd<T>::vec;
  constexpr int64_t W = Simd<T>::width, NV = DC / W;
  vec qv[NH][NV];
  int64_t kv_offset[NH];
  load_pass<DC, NH>(qv, kv_offset, q, h0, G);
  for (int64_t j = 0; j < n; ++j) {
    const S* krow = k + slot[j] * k_row;
    for (int64_t h = 0; h < NH; ++h) {
      const S* kr = krow + kv_offset[h];
      vec p = qv[h][0] * load_vec<T>(kr);
      for (int64_t i = 1; i < NV; ++i) p += qv[h][i] * load_vec<T>(kr + i * W);
      score[(h0 + h) * tile + j] = lane_sum<T>(p);
    }
  }
}

// The same pass for the weighted sum, the heads' accumulators in registers:
// acc[h] += sum_j score[h * tile + j] * V[slot[j]][h / G].
template <int64_t DC, int64_t NH, typename T, typename S>
inline void weighted_sum_pass(T* acc, const T* score, int64_t tile, const S* v, int64_t v_row,
                              const int64_t* slot, int64_t n, int64_t h0, int64_t G) {
  using vec = typename Simd<T>::vec;
  constexpr int64_t W = Simd<T>::width, NV = DC / W;
  vec a[NH][NV];
  int64_t kv_offset[NH];
  load_pass<DC, NH>(a, kv_offset, acc, h0, G);
  for (int64_t j = 0; j < n; ++j) {
    const S* vrow = v + slot[j] * v_row;
    for (int64_t h = 0; h < NH; ++h) {
      const S* vr = vrow + kv_offset[h];
      const T w = score[(h0 + h) * tile + j];
      for (int64_t i = 0; i < NV; ++i) a[h][i] += w * load_vec<T>(vr + i * W);
    }
  }
  for (int64_t h = 0; h < NH; ++h)
    for (int64_t i = 0; i < NV; ++i) reinterpret_cast<vec*>(acc + (h0 + h) * DC)[i] = a[h][i];
}

// Runs pass(nh, h0) over heads 0 .. Hq - 1: passes of NH heads, then single heads
// (nh is a std::integral_constant, so each pass is compiled for its head count).
template <int64_t NH, typename Pass>
inline void in_passes(int64_t Hq, Pass&& pass) {
  int64_t h0 = 0;
  for (; h0 + NH <= Hq; h0 += NH) pass(std::integral_constant<int64_t, NH>{}, h0);
  for (; h0 < Hq; ++h0) pass(std::integral_constant<int64_t, 1>{}, h0);
}

}  // namespace minibatch_simd
