// Paged attention for the CPU: K/V read through the block table, in place.
//
// The same algorithm as the Triton kernel (triton_kernel.py), written as a C++
// loop for a CPU: no gather, no padding, no score matrix in memory.
//
// One work item per query token (torch's threads take them, longest first). For its
// sequence s and absolute position i, the item walks key
// positions p = 0 .. i in tiles of TILE, finds each key's slot through the
// block table (slot = block_tables[s][p / block_size] * block_size +
// p % block_size) and, for every query head, keeps a running max m, a running
// sum l of exp(score - m) and an accumulator acc of exp(score - m) * V: the
// online softmax (Milakov & Gimelshein 2018; FlashAttention's tiling, Dao et
// al. 2022). One item serves all the token's heads, so each K/V row (all KV
// heads, contiguous in the pool) is brought into cache once and read by the
// G = Hq / Hkv query heads that share each KV head (grouped-query attention).
// A float32 sequence with several new tokens (a prompt or a chunk of one) is
// cut instead into blocks of up to W queries and one head each, walked with
// the queries along a vector's lanes (query_block.h): no horizontal sums, and
// the softmax bookkeeping done for W queries at once.
//
// With a cache, the step's new K/V are first written to their slots
// (slot_mapping), then read back like any other key. Without a cache the keys
// are the step's own new tokens: row query_start[s] + p of k and v. Accumulation
// is in float32 (float64 for float64 inputs, so the float64 checks stay exact).
//
// A tile's two inner loops, the scores and the weighted sum, are plain loops
// here (scores_plain, weighted_sum_plain). For float32, float64 and bfloat16 caches
// with a head size of 32, 64, 80, 96 or 128 they run as explicit-SIMD passes instead
// (simd_passes.h): the same arithmetic, a few heads' rows held in vector
// registers. Every index the kernel follows (slots, block-table entries,
// sequence lengths) is checked against the pool before any work starts.
//
// A quantized cache (kv_cache_dtype fp8 or int8, paged_attention_quantized) holds
// one byte per value and a float32 scale per (slot, KV head): the Python side has
// already written the step's K/V into it, and the kernel dequantizes as it reads.
// A scale multiplies a whole head's row, so it comes out of the dot product
// (q . (s k) = s (q . k)) and into the softmax weight of the V row (w (s v) =
// (w s) v): each K or V row is decoded once into float (integer arithmetic for
// float8 e4m3, a cast for int8) and scaled once per head, not once per value.
//
// Compiled with -ffast-math (compile step only: the library does not link the
// runtime that would flush denormals for the whole process) so that exp() is
// vectorised; the code never relies on infinities (the running max starts at the
// lowest finite value and the first tile does not rescale).
#include <torch/extension.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

#include "query_block.h"
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

// Quantized caches: the stored byte types (int8 as itself, float8 e4m3 as its bits).
// float8 e4m3 ("fn": no infinities): 1 sign, 4 exponent (bias 7), 3 mantissa bits;
// exponent 0 is subnormal (m / 8 x 2^-6). A normal code becomes a float32 by moving
// its bits and rebiasing the exponent (+120); a subnormal one is m x 2^-9. Both are
// computed and one picked, so the compiler vectorises the loop. The two NaN codes
// (0x7f, 0xff) are never written (the quantizer clips to 448).
struct Fp8E4M3 { uint8_t bits; };
template <typename T> struct Tag { using type = T; };

inline float fp8_e4m3_to_float(uint8_t b) {
  const uint32_t sign = static_cast<uint32_t>(b & 0x80) << 24, em = b & 0x7f;
  const uint32_t bits = sign | ((em << 20) + (120u << 23));
  float normal;
  std::memcpy(&normal, &bits, sizeof normal);
  const float sub = static_cast<float>(static_cast<int32_t>(em)) * (1.0f / 512.0f);
  return em < 8 ? (sign ? -sub : sub) : normal;
}

template <typename acc_t, typename cache_t>
inline void decode_row(acc_t* dst, const cache_t* src, int64_t n) {
  if constexpr (std::is_same_v<cache_t, Fp8E4M3>) {
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<acc_t>(fp8_e4m3_to_float(bytes[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<acc_t>(src[i]);
  }
}

// Scales of a quantized cache: [num_slots, Hkv] float32, slot stride Hkv (per token
// and head) or 0 (static per head).
struct Scales {
  const float* k = nullptr;
  const float* v = nullptr;
  int64_t k_slot = 0, v_slot = 0;
};

// A tile's scores over a quantized cache: each K row (all KV heads) decoded once into
// row_buf, each head's dot product scaled by its slot's scale.
template <int64_t DC, typename acc_t, typename cache_t>
inline void scores_quant(acc_t* score, const acc_t* q, const cache_t* k, int64_t k_row, const Scales& sc,
                         const int64_t* slot, int64_t n, int64_t Hq, int64_t G, int64_t D, acc_t* row_buf) {
  for (int64_t j = 0; j < n; ++j) {
    decode_row(row_buf, k + slot[j] * k_row, k_row);
    const float* s = sc.k + slot[j] * sc.k_slot;
    for (int64_t h = 0; h < Hq; ++h)
      score[h * TILE + j] = dot<DC>(&q[h * D], row_buf + (h / G) * D, D) * static_cast<acc_t>(s[h / G]);
  }
}

// A tile's weighted sum over a quantized cache: V rows decoded once, the scale folded
// into each head's softmax weight.
template <typename acc_t, typename cache_t>
inline void weighted_sum_quant(acc_t* acc, const acc_t* score, const cache_t* v, int64_t v_row, const Scales& sc,
                               const int64_t* slot, int64_t n, int64_t Hq, int64_t G, int64_t D, acc_t* row_buf) {
  for (int64_t j = 0; j < n; ++j) {
    decode_row(row_buf, v + slot[j] * v_row, v_row);
    const float* s = sc.v + slot[j] * sc.v_slot;
    for (int64_t h = 0; h < Hq; ++h) {
      const acc_t w = score[h * TILE + j] * static_cast<acc_t>(s[h / G]);
      const acc_t* vr = row_buf + (h / G) * D;
      acc_t* a = &acc[h * D];
      for (int64_t d = 0; d < D; ++d) a[d] += w * vr[d];
    }
  }
}

template <typename scalar_t, typename cache_t, int64_t DC>
void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& k_cache,
            const at::Tensor& v_cache, const at::Tensor& slot_mapping, at::Tensor& out,
            const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_start,
            int64_t block_size, bool use_simd, const Scales& quant = Scales{}) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr bool quantized = !std::is_same_v<cache_t, scalar_t>;   // then always paged, already written
  // the explicit-SIMD passes where the cache holds the accumulation type (float32, float64)
  // or bfloat16 (read as float32); use_simd=false runs the plain loops instead (chapter 10
  // measures the difference)
  constexpr bool simd_ok = !quantized && simd_dtype<scalar_t>() && DC > 0 && DC % Simd<acc_t>::width == 0;
  const bool simd = simd_ok && use_simd;
  constexpr int64_t NH = Simd<acc_t>::template heads_per_pass<DC>;
  const bool paged = k_cache.numel() > 0;
  const int64_t T = q.size(0), Hq = q.size(1), D = DC > 0 ? DC : q.size(2), Hkv = k.size(1), G = Hq / Hkv;
  const int64_t S = seq_lens.size(0), row = Hkv * D;
  // q, k, v may be views into the fused qkv projection: rows of tokens with a stride
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0), v_stride = v.stride(0);
  const scalar_t* qp = q.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  if constexpr (!quantized) if (paged) {   // write the step's new K/V into their slots first (reshape_and_cache)
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
  const cache_t* kp;
  const cache_t* vp;
  if constexpr (quantized) {
    kp = static_cast<const cache_t*>(k_cache.data_ptr());
    vp = static_cast<const cache_t*>(v_cache.data_ptr());
  } else {
    kp = paged ? k_cache.data_ptr<scalar_t>() : k.data_ptr<scalar_t>();
    vp = paged ? v_cache.data_ptr<scalar_t>() : v.data_ptr<scalar_t>();
  }
  const int64_t k_row = paged ? row : k_stride, v_row = paged ? row : v_stride;
  const int64_t row_bytes = row * static_cast<int64_t>(sizeof(cache_t));   // one token's K (or V), all heads
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

  // Work items: a query token (all its heads), or, for a sequence with several new
  // tokens in a float32 step, a block of up to W of them and one head (query_block.h).
  constexpr bool blocks_ok = simd_ok && std::is_same_v<scalar_t, float>;
  constexpr int64_t W = Simd<acc_t>::width;
  struct Item { int64_t t, nq, h; };   // nq == 0: token t, every head
  std::vector<Item> items;
  items.reserve(T);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t q_len = qs[s + 1] - qs[s];
    if (blocks_ok && simd && q_len > 1) {
      for (int64_t t0 = qs[s]; t0 < qs[s + 1]; t0 += W)
        for (int64_t h = 0; h < Hq; ++h) items.push_back({t0, std::min(W, qs[s + 1] - t0), h});
    } else {
      for (int64_t t = qs[s]; t < qs[s + 1]; ++t) items.push_back({t, 0, 0});
    }
  }
  const int64_t num_items = static_cast<int64_t>(items.size());
  // The threads take items from a shared counter, each taking the next one when it is
  // done: they finish together whatever mix of contexts the batch holds, and a thread
  // slowed by another process on its core takes fewer. The costliest sequences come
  // first (a sequence's items stay together, so the threads share its K/V in cache),
  // and within a sequence the longest items. An item's cost is its keys times the
  // vector passes per key: one per head for a token, W queries at once for a block.
  // Each item writes only its own rows, so the order changes no result.
  std::vector<int64_t> cost(num_items), order(num_items), seq_cost(S, 0);
  for (int64_t i = 0; i < num_items; ++i) {
    const Item& w = items[i];
    const int64_t s = seq_of[w.t], keys = sl[s] - (qs[s + 1] - qs[s]) + (w.t - qs[s]) + std::max<int64_t>(w.nq, 1);
    cost[i] = keys * (w.nq > 0 ? W : Hq);
    seq_cost[s] += cost[i];
  }
  std::iota(order.begin(), order.end(), int64_t(0));
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const int64_t sa = seq_of[items[a].t], sb = seq_of[items[b].t];
    if (sa != sb) return seq_cost[sa] != seq_cost[sb] ? seq_cost[sa] > seq_cost[sb] : sa < sb;
    return cost[a] > cost[b];
  });
  std::atomic<int64_t> next_item{0};
  const int64_t workers = std::min<int64_t>(num_items, at::get_num_threads());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<acc_t> qf(Hq * D), acc(Hq * D), m(Hq), l(Hq), score(Hq * TILE);
    std::vector<int64_t> slot(TILE), next_slot(TILE);
    // a query block's scratch (query_block.h): transposed queries, accumulators, scores
    std::vector<float> block_buf(blocks_ok && simd ? (2 * D + TILE) * W : 0);
    std::vector<acc_t> row_buf(quantized ? row : 0);   // one decoded K or V row (all KV heads)
    // a tile's two inner loops: the explicit-SIMD passes where they apply, else the plain loops
    auto scores = [&](int64_t n) {
      if constexpr (quantized) {
        return scores_quant<DC>(score.data(), qf.data(), kp, k_row, quant, slot.data(), n, Hq, G, D, row_buf.data());
      }
      if constexpr (simd_ok) {
        if (simd)
          return in_passes<NH>(Hq, [&](auto nh, int64_t h0) {
            scores_pass<DC, decltype(nh)::value>(score.data(), TILE, qf.data(), kp, k_row, slot.data(), n, h0, G);
          });
      }
      if constexpr (!quantized) scores_plain<DC>(score.data(), qf.data(), kp, k_row, slot.data(), n, Hq, G, D);
    };
    auto weighted_sum = [&](int64_t n) {
      if constexpr (quantized) {
        return weighted_sum_quant(acc.data(), score.data(), vp, v_row, quant, slot.data(), n, Hq, G, D,
                                  row_buf.data());
      }
      if constexpr (simd_ok) {
        if (simd)
          return in_passes<NH>(Hq, [&](auto nh, int64_t h0) {
            weighted_sum_pass<DC, decltype(nh)::value>(acc.data(), score.data(), TILE, vp, v_row, slot.data(), n,
                                                       h0, G);
          });
      }
      if constexpr (!quantized) weighted_sum_plain(acc.data(), score.data(), vp, v_row, slot.data(), n, Hq, G, D);
    };
    for (int64_t k = next_item.fetch_add(1, std::memory_order_relaxed); k < num_items;
         k = next_item.fetch_add(1, std::memory_order_relaxed)) {
      const int64_t it = order[k];
      const int64_t t = items[it].t;
      const int64_t s = seq_of[t];
      if constexpr (blocks_ok) if (items[it].nq > 0) {
        const int64_t h = items[it].h, first_pos = sl[s] - (qs[s + 1] - qs[s]) + (t - qs[s]);
        float* b = block_buf.data();
        minibatch_simd::attend_query_block<DC, TILE>(
            op, Hq, qp, q_stride, t, items[it].nq, first_pos, h, h / G, kp, k_row, vp, v_row, scale,
            [&](int64_t start, int64_t n, int64_t* sl_out) { fill_slots(s, start, n, sl_out); },
            {b, b + D * W, b + 2 * D * W, slot.data()});
        continue;
      }
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
        // Find the next tile's slots now and prefetch every cache line of its rows, with the
        // far-cache hint (prefetcht2): hardware prefetchers stop at page edges, and a
        // sequence's blocks lie anywhere in the pool. (Prefetching only the first line of
        // every other row, into L1, read a decode batch's cache from DRAM 1.4-1.8x slower on
        // this book's machine.)
        const int64_t n_next = std::min(TILE, num_keys - start - n);
        if (n_next > 0) {
          fill_slots(s, start + n, n_next, next_slot.data());
          for (int64_t j = 0; j < n_next; ++j) {
            const char* kr = reinterpret_cast<const char*>(kp + next_slot[j] * k_row);
            const char* vr = reinterpret_cast<const char*>(vp + next_slot[j] * v_row);
            for (int64_t b = 0; b < row_bytes; b += 64) {
              __builtin_prefetch(kr + b, 0, 1);
              __builtin_prefetch(vr + b, 0, 1);
            }
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
  for (int64_t t = 0; t < slot_mapping.numel(); ++t)   // none when the cache was written before
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
      attend<scalar_t, scalar_t, decltype(dc)::value>(q, k, v, k_cache, v_cache, slot_mapping, out, block_tables,
                                                      seq_lens, query_start, block_size, use_simd);
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

// The kernel over a quantized cache (kv_cache_dtype fp8 or int8), already written:
// q: [T, Hq, D] (float32, float64, bfloat16 or float16); k_cache, v_cache: [num_slots,
// Hkv, D] of int8 or float8_e4m3fn, contiguous; k_scale, v_scale: [num_slots, Hkv]
// float32 with unit head stride and a slot stride of Hkv (a scale per token and head)
// or 0 (static scales); block_tables, seq_lens, query_start as for paged_attention.
// Returns [T, Hq, D] in q's dtype.
at::Tensor paged_attention_quantized(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                     const at::Tensor& k_scale, const at::Tensor& v_scale,
                                     const at::Tensor& block_tables, const at::Tensor& seq_lens,
                                     const at::Tensor& query_start, int64_t block_size) {
  for (const auto* t : {&q, &k_cache, &v_cache, &k_scale, &v_scale, &block_tables, &seq_lens, &query_start})
    TORCH_CHECK(t->device().is_cpu(), "paged_attention_quantized: CPU tensors only");
  const auto ct = k_cache.scalar_type();
  TORCH_CHECK(ct == at::kChar || ct == at::kFloat8_e4m3fn, "paged_attention_quantized: the cache must be int8 or "
              "float8_e4m3fn, got ", ct);
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && (q.size(1) == 1 || q.stride(1) == q.size(2)),
              "paged_attention_quantized: q must be [T, Hq, D] with each token's heads contiguous");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == ct && k_cache.size(2) == q.size(2) &&
                  q.size(1) % k_cache.size(1) == 0,
              "paged_attention_quantized: caches must be contiguous [num_slots, Hkv, D] of one dtype, Hq a multiple "
              "of Hkv");
  const int64_t num_slots = k_cache.size(0), Hkv = k_cache.size(1);
  for (const auto* s : {&k_scale, &v_scale})
    TORCH_CHECK(s->scalar_type() == at::kFloat && s->dim() == 2 && s->size(0) == num_slots && s->size(1) == Hkv &&
                    s->stride(1) == 1 && (s->stride(0) == Hkv || s->stride(0) == 0),
                "paged_attention_quantized: scales must be float32 [num_slots, Hkv], slot stride Hkv or 0");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && query_start.scalar_type() == at::kLong &&
                  seq_lens.is_contiguous() && query_start.is_contiguous() && query_start.size(0) == seq_lens.size(0) + 1,
              "paged_attention_quantized: seq_lens [S] and query_start [S + 1] must be contiguous int64");
  TORCH_CHECK(block_size > 0 && block_tables.scalar_type() == at::kLong && block_tables.is_contiguous() &&
                  block_tables.dim() == 2 && block_tables.size(0) == seq_lens.size(0),
              "paged_attention_quantized: block tables must be contiguous int64 [S, max_blocks], block_size > 0");
  // no slots to write (done already): an empty slot mapping, checked as zero tokens would be
  const auto no_slots = at::empty({0}, seq_lens.options());
  check_indices(q.size(0), num_slots, no_slots, block_tables, seq_lens, query_start, block_size, true);
  Scales sc{k_scale.data_ptr<float>(), v_scale.data_ptr<float>(), k_scale.stride(0), v_scale.stride(0)};
  auto out = at::empty(q.sizes(), q.options());
  const auto k_shape = at::empty({q.size(0), Hkv, q.size(2)}, q.options());   // attend reads k's sizes only
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_quantized", [&] {
    auto run = [&](auto cache_tag, auto dc) {
      using cache_t = typename decltype(cache_tag)::type;
      attend<scalar_t, cache_t, decltype(dc)::value>(q, k_shape, k_shape, k_cache, v_cache, no_slots, out,
                                                     block_tables, seq_lens, query_start, block_size, false, sc);
    };
    auto by_dim = [&](auto cache_tag) {
      switch (q.size(2)) {
        case 64: run(cache_tag, std::integral_constant<int64_t, 64>{}); break;
        case 128: run(cache_tag, std::integral_constant<int64_t, 128>{}); break;
        default: run(cache_tag, std::integral_constant<int64_t, 0>{});
      }
    };
    if (ct == at::kChar) by_dim(Tag<int8_t>{});
    else by_dim(Tag<Fp8E4M3>{});
  });
  return out;
}
