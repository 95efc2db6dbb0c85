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
// are the step's own new tokens: row query_start[s] + p of k and v. Accumulation
// is in float32 (float64 for float64 inputs, so the float64 checks stay exact).
//
// A tile's two inner loops, the scores and the weighted sum, are plain loops
// here (scores_plain, weighted_sum_plain). For float32 and float64 caches with a
// head size of 64 or 128 they run as explicit-SIMD passes instead
// (simd_passes.h): the same arithmetic, a few heads' rows held in vector
// registers. Every index the kernel follows (slots, block-table entries,
// sequence lengths) is checked against the pool before any work starts.
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

#include "simd_passes.h"

namespace {

using minibatch_simd::in_passes;
using minibatch_simd::scores_pass;
using minibatch_simd::Simd;
using minibatch_simd::weighted_sum_pass;

constexpr int64_t TILE = 32;   // key positions scored before each rescale of acc

// cache types the explicit-SIMD passes read: those the arithmetic is done in, and bfloat16
template <typename scalar_t>
constexpr bool simd_dtype() {
  using acc_t = at::opmath_type<scalar_t>;
  return std::is_same_v<acc_t, scalar_t> || (std::is_same_v<scalar_t, c10::BFloat16> && std::is_same_v<acc_t, float>);
}
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

// A tile's scores, plainly: score[h * TILE + j] = q[h] . K[slot[j]][h / G] for its n keys,
// every head reading each K row while it is in cache.
template <int64_t DC, typename acc_t, typename scalar_t>
inline void scores_plain(acc_t* score, const acc_t* q, const scalar_t* k, int64_t k_row,
                         const int64_t* slot, int64_t n, int64_t Hq, int64_t G, int64_t D) {
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* krow = k + slot[j] * k_row;
    for (int64_t h = 0; h < Hq; ++h)
      score[h * TILE + j] = dot<DC>(&q[h * D], krow + (h / G) * D, D);
  }
}

// A tile's weighted sum, plainly: acc[h] += sum_j score[h * TILE + j] * V[slot[j]][h / G].
template <typename acc_t, typename scalar_t>
inline void weighted_sum_plain(acc_t* acc, const acc_t* score, const scalar_t* v, int64_t v_row,
                               const int64_t* slot, int64_t n, int64_t Hq, int64_t G, int64_t D) {
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* vrow = v + slot[j] * v_row;
    for (int64_t h = 0; h < Hq; ++h) {
      const acc_t w = score[h * TILE + j];
      const scalar_t* vr = vrow + (h / G) * D;
      acc_t* a = &acc[h * D];
      for (int64_t d = 0; d < D; ++d) a[d] += w * static_cast<acc_t>(vr[d]);
    }
  }
}

template <typename scalar_t, int64_t DC>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& slot_mapping, at::Tensor& out,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
            int64_t block_size, bool use_simd) {
  using acc_t = at::opmath_type<scalar_t>;
  // the explicit-SIMD passes where the cache holds the accumulation type (float32, float64)
  // or bfloat16 (read as float32); use_simd=false runs the plain loops instead (chapter 10
  // measures the difference)
  constexpr bool simd_ok = simd_dtype<scalar_t>() && DC > 0 && DC % Simd<acc_t>::width == 0;
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
    // a tile's two inner loops: the explicit-SIMD passes where they apply, else the plain loops
    auto scores = [&](int64_t n) {
      if constexpr (simd_ok) {
        if (simd)
          return in_passes<NH>(Hq, [&](auto nh, int64_t h0) {
            scores_pass<DC, decltype(nh)::value>(score.data(), TILE, qf.data(), kp, k_row, slot.data(), n, h0, G);
          });
      }
      scores_plain<DC>(score.data(), qf.data(), kp, k_row, slot.data(), n, Hq, G, D);
    };
    auto weighted_sum = [&](int64_t n) {
      if constexpr (simd_ok) {
        if (simd)
          return in_passes<NH>(Hq, [&](auto nh, int64_t h0) {
            weighted_sum_pass<DC, decltype(nh)::value>(acc.data(), score.data(), TILE, vp, v_row, slot.data(), n,
                                                       h0, G);
          });
      }
      weighted_sum_plain(acc.data(), score.data(), vp, v_row, slot.data(), n, Hq, G, D);
    };
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
        scores(n);   // every head's scores for the tile's keys
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
        weighted_sum(n);   // then every head's weighted sum of the tile's V rows
      }
      for (int64_t h = 0; h < Hq; ++h) {
        scalar_t* dst = op + (t * Hq + h) * D;
        const acc_t inv = acc_t(1) / l[h];
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<scalar_t>(acc[h * D + d] * inv);
      }
    }
  });
}

// Every index the kernel will follow, checked before any work: a wrong slot or block id
// would read or write outside the pool. query_start runs 0 .. T without going back; a
// sequence's context holds at least its new tokens (exactly them without a cache); with a
// cache every slot, and every block-table entry the context reaches, lies in the pool.
void check_indices(int64_t T, int64_t num_slots, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                   const at::Tensor& seq_lens, const at::Tensor& query_start, int64_t block_size, bool paged) {
  const int64_t S = seq_lens.size(0);
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* sl = seq_lens.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[S] == T, "paged_attention: query_start must run from 0 to the ", T, " tokens");
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qs[s + 1] - qs[s];
    TORCH_CHECK(q_len >= 0, "paged_attention: query_start goes back at sequence ", s);
    TORCH_CHECK(paged ? sl[s] >= q_len : sl[s] == q_len, "paged_attention: sequence ", s, " has ", sl[s],
                " tokens of context for ", q_len, " new ones");
  }
  if (!paged) return;
  TORCH_CHECK(num_slots % block_size == 0, "paged_attention: ", num_slots, " slots are not whole blocks of ",
              block_size);
  const int64_t num_blocks = num_slots / block_size, width = block_tables.size(1);
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sm[t] >= 0 && sm[t] < num_slots, "paged_attention: slot ", sm[t], " of token ", t,
                " is outside the pool's ", num_slots, " slots");
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  for (int64_t s = 0; s < S; ++s) {
    const int64_t used = (sl[s] + block_size - 1) / block_size;
    TORCH_CHECK(used <= width, "paged_attention: sequence ", s, " needs ", used, " blocks; its table has ", width);
    for (int64_t b = 0; b < used; ++b)
      TORCH_CHECK(bt[s * width + b] >= 0 && bt[s * width + b] < num_blocks, "paged_attention: block ",
                  bt[s * width + b], " in sequence ", s, "'s table is outside the pool's ", num_blocks, " blocks");
  }
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
  check_indices(q.size(0), paged ? k_cache.size(0) : 0, slot_mapping, block_tables, seq_lens, query_start,
                block_size, paged);
  auto out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    // the common head sizes get their own compiled loops (fully unrolled over D)
    auto run = [&](auto dc) {
      attend<scalar_t, decltype(dc)::value>(q, k, v, k_cache, v_cache, slot_mapping, out, block_tables, seq_lens,
                                            query_start, block_size, use_simd);
    };
    switch (q.size(2)) {
      case 32: run(std::integral_constant<int64_t, 32>{}); break;
      case 64: run(std::integral_constant<int64_t, 64>{}); break;
      case 80: run(std::integral_constant<int64_t, 80>{}); break;
      case 96: run(std::integral_constant<int64_t, 96>{}); break;
      case 128: run(std::integral_constant<int64_t, 128>{}); break;
      default: run(std::integral_constant<int64_t, 0>{});
    }
  });
  return out;
}

// Whether a cache of this dtype and head size takes the explicit-SIMD passes (the head
// sizes of Llama and GPT-2 checkpoints: 32, 64, 80, 96, 128).
bool simd_path(at::ScalarType dtype, int64_t head_dim) {
  bool yes = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "simd_path", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    const bool sized = head_dim == 32 || head_dim == 64 || head_dim == 80 || head_dim == 96 || head_dim == 128;
    yes = simd_dtype<scalar_t>() && sized && head_dim % Simd<acc_t>::width == 0;
  });
  return yes;
}
