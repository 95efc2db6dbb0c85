// Paged attention for the CPU: K/V read through the block table, in place.
//
// The same algorithm as the Triton kernel (triton_kernel.py), written as a C++
// loop for a CPU: no gather, no padding, no score matrix in memory.
//
// One work item per query token (at::parallel_for over torch's threads). For its
// sequence s and absolute position i, the item walks key
// positions p = 0 .. i in tiles of TILE, finds each key's slot through the
// block table (slot = block_tables[s][p / block_size] * block_size +
// p % block_size) and, for every query head, keeps a running max m, a running
// sum l of exp(score - m) and an accumulator acc of exp(score - m) * V: the
// online softmax (Milakov & Gimelshein 2018; FlashAttention's tiling, Dao et
// al. 2022). One item serves all the token's heads, so each K/V row (all KV
// heads, contiguous in the pool) is brought into cache once and read by the
// G = Hq / Hkv query heads that share each KV head (grouped-query attention).
//
// With a cache, the step's new K/V are first written to their slots
// (slot_mapping), then read back like any other key. Without a cache the keys
// are the step's own new tokens: row query_start[s] + p of k and v. Accumulation is in float32 (float64 for float64
// inputs, so the float64 checks stay exact).
//
// For float32 and float64 caches with a head size of 64 or 128 (the common ones), the
// two inner loops are written with explicit SIMD vectors (GCC/Clang vector types):
// the passes below keep a few heads' query or accumulator rows in registers while
// they walk the tile's K or V rows front to back. Left to itself, the compiler kept
// the accumulators in memory and summed each dot product's lanes one by one (and,
// with the loops reordered, vectorised the loop over keys, with gathers). On an
// AVX-512 CPU the explicit passes took about half the time per key on K/V already
// in cache, and made the workload's decode attention about an eighth faster. Other
// dtypes and head sizes take the plain loops: the same algorithm.
//
// Compiled with -ffast-math (compile step only: the library does not link the
// runtime that would flush denormals for the whole process) so that exp() is
// vectorised; the code never relies on infinities (the running max starts at the
// lowest finite value and the first tile does not rescale).
#include <torch/extension.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t TILE = 32;   // key positions scored before each rescale of acc
constexpr int LANES = 16;     // independent partial sums, so the compiler can vectorise the dot product

template <int64_t DC, typename acc_t, typename scalar_t>
inline acc_t dot(const acc_t* q, const scalar_t* k, int64_t D_runtime) {
  const int64_t D = DC > 0 ? DC : D_runtime;   // a compile-time head size unrolls the loop
  acc_t part[LANES] = {};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES)
    for (int j = 0; j < LANES; ++j) part[j] += q[d + j] * static_cast<acc_t>(k[d + j]);
  acc_t s = 0;
  for (int j = 0; j < LANES; ++j) s += part[j];
  for (; d < D; ++d) s += q[d] * static_cast<acc_t>(k[d]);
  return s;
}

// ---- Explicit SIMD: float32 / float64 caches, a compile-time head size ----------------

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
// registers: score[h][j] = q[h] . K[slot[j]][h / G]. Each K row is read once per pass.
template <int64_t DC, int64_t NH, typename T>
inline void scores_pass(T* score, const T* q, const T* k, int64_t k_row, const int64_t* slot,
                        int64_t n, int64_t h0, int64_t G) {
  using vec = typename Simd<T>::vec;
  constexpr int64_t NV = DC / Simd<T>::width;
  vec qv[NH][NV];
  int64_t kv_offset[NH];
  load_pass<DC, NH>(qv, kv_offset, q, h0, G);
  for (int64_t j = 0; j < n; ++j) {
    const T* krow = k + slot[j] * k_row;
    for (int64_t h = 0; h < NH; ++h) {
      const vec* kr = reinterpret_cast<const vec*>(krow + kv_offset[h]);
      vec p = qv[h][0] * kr[0];
      for (int64_t i = 1; i < NV; ++i) p += qv[h][i] * kr[i];
      score[(h0 + h) * TILE + j] = lane_sum<T>(p);
    }
  }
}

// The same pass for the weighted sum, the heads' accumulators in registers:
// acc[h] += sum_j score[h][j] * V[slot[j]][h / G].
template <int64_t DC, int64_t NH, typename T>
inline void weighted_sum_pass(T* acc, const T* score, const T* v, int64_t v_row, const int64_t* slot,
                              int64_t n, int64_t h0, int64_t G) {
  using vec = typename Simd<T>::vec;
  constexpr int64_t NV = DC / Simd<T>::width;
  vec a[NH][NV];
  int64_t kv_offset[NH];
  load_pass<DC, NH>(a, kv_offset, acc, h0, G);
  for (int64_t j = 0; j < n; ++j) {
    const T* vrow = v + slot[j] * v_row;
    for (int64_t h = 0; h < NH; ++h) {
      const vec* vr = reinterpret_cast<const vec*>(vrow + kv_offset[h]);
      const T w = score[(h0 + h) * TILE + j];
      for (int64_t i = 0; i < NV; ++i) a[h][i] += w * vr[i];
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

template <typename scalar_t, int64_t DC>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& slot_mapping, at::Tensor& out,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
            int64_t block_size, bool use_simd) {
  using acc_t = at::opmath_type<scalar_t>;
  // the explicit-SIMD passes where the cache holds the accumulation type (float32, float64);
  // use_simd=false runs the plain loops instead (chapter 10 measures the difference)
  constexpr bool simd_ok = std::is_same_v<acc_t, scalar_t> && DC > 0 && DC % Simd<acc_t>::width == 0;
  const bool simd = simd_ok && use_simd;
  constexpr int64_t NH = Simd<acc_t>::template heads_per_pass<DC>;
  const bool paged = k_cache.numel() > 0;
  const int64_t T = q.size(0), Hq = q.size(1), D = DC > 0 ? DC : q.size(2), Hkv = k.size(1), G = Hq / Hkv;
  const int64_t S = seq_lens.size(0), row = Hkv * D;
  // q, k, v may be views into the fused qkv projection: rows of tokens with a stride
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0), v_stride = v.stride(0);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  if (paged) {   // write the step's new K/V into their slots first (reshape_and_cache)
    const int64_t* sm = slot_mapping.data_ptr<int64_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const scalar_t* kn = k.data_ptr<scalar_t>();
    const scalar_t* vn = v.data_ptr<scalar_t>();
    at::parallel_for(0, T, 64, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        std::copy(kn + t * k_stride, kn + t * k_stride + row, kc + sm[t] * row);
        std::copy(vn + t * v_stride, vn + t * v_stride + row, vc + sm[t] * row);
      }
    });
  }
  // keys are read from the pool through the block table, or from the step's own rows
  const scalar_t* kp = paged ? k_cache.data_ptr<scalar_t>() : k.data_ptr<scalar_t>();
  const scalar_t* vp = paged ? v_cache.data_ptr<scalar_t>() : v.data_ptr<scalar_t>();
  const int64_t k_row = paged ? row : k_stride, v_row = paged ? row : v_stride;
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* bt = paged ? block_tables.data_ptr<int64_t>() : nullptr;
  const int64_t bt_stride = paged ? block_tables.size(1) : 0;
  std::vector<int64_t> seq_of(T);
  for (int64_t s = 0; s < S; ++s)
    for (int64_t t = qs[s]; t < qs[s + 1]; ++t) seq_of[t] = s;
  const acc_t scale = acc_t(1) / std::sqrt(static_cast<acc_t>(D));
  // where key positions start .. start + n - 1 of sequence s live, block by block
  // (one division per block, not per key)
  auto fill_slots = [&](int64_t s, int64_t start, int64_t n, int64_t* slot) {
    if (!paged) {
      for (int64_t j = 0; j < n; ++j) slot[j] = qs[s] + start + j;
      return;
    }
    for (int64_t j = 0, p = start; j < n;) {
      const int64_t off = p % block_size, base = bt[s * bt_stride + p / block_size] * block_size + off;
      const int64_t run = std::min(block_size - off, n - j);
      for (int64_t i = 0; i < run; ++i) slot[j + i] = base + i;
      j += run;
      p += run;
    }
  };
  const acc_t lowest = std::numeric_limits<acc_t>::lowest();

  // Work items are cut round-robin into a few chunks per thread, so long and short
  // contexts are spread over the threads whatever order the batch is in.
  const int64_t chunks = std::min<int64_t>(T, 8 * at::get_num_threads());
  at::parallel_for(0, chunks, 1, [&](int64_t chunk_begin, int64_t chunk_end) {
    std::vector<acc_t> qf(Hq * D), acc(Hq * D), m(Hq), l(Hq), score(Hq * TILE);
    std::vector<int64_t> slot(TILE), next_slot(TILE);
    for (int64_t c = chunk_begin; c < chunk_end; ++c)
    for (int64_t t = c; t < T; t += chunks) {
      const int64_t s = seq_of[t];
      const int64_t q_len = qs[s + 1] - qs[s];
      const int64_t num_keys = sl[s] - q_len + (t - qs[s]) + 1;  // causal: keys 0 .. own position
      for (int64_t h = 0; h < Hq; ++h) {
        const scalar_t* src = qp + t * q_stride + h * D;
        for (int64_t d = 0; d < D; ++d) qf[h * D + d] = static_cast<acc_t>(src[d]) * scale;
        m[h] = lowest;
        l[h] = 0;
      }
      std::fill(acc.begin(), acc.end(), acc_t(0));
      fill_slots(s, 0, std::min(TILE, num_keys), next_slot.data());
      for (int64_t start = 0; start < num_keys; start += TILE) {
        const int64_t n = std::min(TILE, num_keys - start);
        std::swap(slot, next_slot);
        // Find the next tile's slots now and hint its rows (every other row's start):
        // hardware prefetchers stop at page edges, and a sequence's blocks lie anywhere in the pool.
        const int64_t n_next = std::min(TILE, num_keys - start - n);
        if (n_next > 0) {
          fill_slots(s, start + n, n_next, next_slot.data());
          for (int64_t j = 0; j < n_next; j += 2) {
            __builtin_prefetch(kp + next_slot[j] * k_row);
            __builtin_prefetch(vp + next_slot[j] * v_row);
          }
        }
        // scores of every head for the tile's keys: each K row is read once by all heads
        // (by each pass of NH heads, on the SIMD path)
        if constexpr (simd_ok) {
          if (simd)
            in_passes<NH>(Hq, [&](auto nh, int64_t h0) {
              scores_pass<DC, decltype(nh)::value>(score.data(), qf.data(), kp, k_row, slot.data(), n,
                                                   h0, G);
            });
        }
        if (!simd) {
          for (int64_t j = 0; j < n; ++j) {
            const scalar_t* krow = kp + slot[j] * k_row;
            for (int64_t h = 0; h < Hq; ++h)
              score[h * TILE + j] = dot<DC>(&qf[h * D], krow + (h / G) * D, D);
          }
        }
        for (int64_t h = 0; h < Hq; ++h) {
          acc_t* sc = &score[h * TILE];
          acc_t tile_max = lowest;
          for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, sc[j]);
          const acc_t m_new = std::max(m[h], tile_max);
          const acc_t alpha = start == 0 ? acc_t(0) : std::exp(m[h] - m_new);  // rescales the old sums
          acc_t sum = 0;
          for (int64_t j = 0; j < n; ++j) {
            sc[j] = std::exp(sc[j] - m_new);
            sum += sc[j];
          }
          l[h] = l[h] * alpha + sum;
          m[h] = m_new;
          acc_t* a = &acc[h * D];
          for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
        }
        // then every head's weighted sum of the tile's V rows, each row read once (per pass)
        if constexpr (simd_ok) {
          if (simd)
            in_passes<NH>(Hq, [&](auto nh, int64_t h0) {
              weighted_sum_pass<DC, decltype(nh)::value>(acc.data(), score.data(), vp, v_row, slot.data(),
                                                         n, h0, G);
            });
        }
        if (!simd) {
          for (int64_t j = 0; j < n; ++j) {
            const scalar_t* vrow = vp + slot[j] * v_row;
            for (int64_t h = 0; h < Hq; ++h) {
              const acc_t w = score[h * TILE + j];
              const scalar_t* vr = vrow + (h / G) * D;
              acc_t* a = &acc[h * D];
              for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<acc_t>(vr[d]);
            }
          }
        }
      }
      for (int64_t h = 0; h < Hq; ++h) {
        scalar_t* dst = op + (t * Hq + h) * D;
        const acc_t inv = acc_t(1) / l[h];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[h * D + d] * inv);
      }
    }
  });
}

}  // namespace

// q: [T, Hq, D]; k, v: [T, Hkv, D], the step's new K/V (token rows may be strided,
// each row contiguous); k_cache, v_cache: [num_slots, Hkv, D], one layer's pool, or
// empty tensors for a cache-free forward (keys are then the new tokens themselves);
// slot_mapping: [T] where each new token's K/V goes; block_tables: [S, max_blocks];
// seq_lens: [S]; query_start: [S + 1] (all int64); use_simd: the explicit-SIMD passes where
// they apply (false: the plain loops everywhere). Returns [T, Hq, D].
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start, int64_t block_size,
                           bool use_simd) {
  const bool paged = k_cache.numel() > 0;
  for (const auto* t : {&q, &k, &v, &k_cache, &v_cache, &slot_mapping, &block_tables, &seq_lens, &query_start})
    TORCH_CHECK(t->device().is_cpu(), "paged_attention: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && q.size(0) == k.size(0),
              "paged_attention: q must be [T, Hq, D] and k, v [T, Hkv, D]");
  TORCH_CHECK(q.size(2) == k.size(2) && q.size(1) % k.size(1) == 0, "paged_attention: head mismatch");
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->stride(2) == 1 && (t->size(1) == 1 || t->stride(1) == t->size(2)), "paged_attention: each token's heads must be contiguous");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "paged_attention: q, k and v must share a dtype");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && query_start.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous() && query_start.is_contiguous() && query_start.size(0) == seq_lens.size(0) + 1,
              "paged_attention: seq_lens [S] and query_start [S + 1] must be contiguous int64");
  if (paged) {
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                    v_cache.sizes() == k_cache.sizes() && k_cache.size(1) == k.size(1) && k_cache.size(2) == k.size(2) &&
                    k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
                "paged_attention: caches must be contiguous [num_slots, Hkv, D] of q's dtype");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == q.size(0),
                "paged_attention: slot_mapping must be [T] int64");
    TORCH_CHECK(block_size > 0 && block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                    block_tables.dim() == 2 && block_tables.size(0) == seq_lens.size(0),
                "paged_attention: block tables must be contiguous int64 [S, max_blocks], block_size > 0");
  }
  auto out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    // the common head sizes get their own compiled loops (fully unrolled over D)
    switch (q.size(2)) {
      case 64: attend<scalar_t, 64>(q, k, v, k_cache, v_cache, slot_mapping, out, block_tables, seq_lens, query_start, block_size, use_simd); break;
      case 128: attend<scalar_t, 128>(q, k, v, k_cache, v_cache, slot_mapping, out, block_tables, seq_lens, query_start, block_size, use_simd); break;
      default: attend<scalar_t, 0>(q, k, v, k_cache, v_cache, slot_mapping, out, block_tables, seq_lens, query_start, block_size, use_simd);
    }
  });
  return out;
}
