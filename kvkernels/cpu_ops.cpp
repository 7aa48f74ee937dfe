// CPU kernels of the engine's hot decode path, built at first use by kvkernels/cpu.py.
//
// decode_attention reads each sequence's K and V straight from its blocks of the paged
// cache (no gathered copy of the context) and computes the attention of its one new
// token: the query heads that share a KV head are scored against each key row as it is
// loaded, so every K and V byte is read once. The context is cut into partitions that
// the threads share (so that one sequence keeps both cores busy) and the partitions are
// merged by their softmax statistics. write_kv stores a step's new K and V at their
// slots, non-finite values as 0 (see kvkernels/reference.py: the padded torch decode
// relies on every slot being finite). rms_norm is the decoder's RMSNorm in one pass.
// All accumulation is in fp32. copy_runs copies a batch of byte runs (host slots to
// device blocks on a CPU engine) with the bytes split evenly over the threads.
// skinny_linear is x W^T (+ b) for a few rows of x (a decode step): each weight row is
// streamed once and dotted with every row of x, the weight's rows split over the threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

// The dtypes a model runs in (no double: fewer instantiations to compile).
#define KVTIER_DISPATCH_MODEL_TYPES(TYPE, NAME, ...)                                   \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) \
                         AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__)      \
                             AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__))

namespace {

constexpr int64_t kLanes = 16;           // fp32 lanes of one accumulator (one AVX-512 register)
constexpr int64_t kPartitionTokens = 128;  // context tokens per unit of parallel work (whole blocks)

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) { return static_cast<T>(x); }

// sum_d a[d] * b[d] over `n` values (kDim when it is known at compile time), with kLanes
// partial sums so that the loop vectorizes without reassociating one sum.
template <int64_t kDim, typename T>
inline float dot(const float* a, const T* b, int64_t n) {
  const int64_t size = kDim > 0 ? kDim : n;
  float lanes[kLanes] = {0.f};
  int64_t d = 0;
  for (; d + kLanes <= size; d += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += a[d + j] * to_float(b[d + j]);
  }
  float sum = 0.f;
  for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
  for (; d < size; ++d) sum += a[d] * to_float(b[d]);
  return sum;
}

// acc[d] += weight * v[d]
template <int64_t kDim, typename T>
inline void axpy(float* __restrict__ acc, float weight, const T* __restrict__ v, int64_t n) {
  const int64_t size = kDim > 0 ? kDim : n;
  for (int64_t d = 0; d < size; ++d) acc[d] += weight * to_float(v[d]);
}

// A unit of parallel work: whole blocks [first_block, end_block) of one sequence's
// context, every KV head (a block's K, then its V, is one contiguous run of memory: reading
// all of its heads together keeps the reads sequential).
struct Partition {
  int64_t seq, first_block, end_block;
};

struct DecodeGeometry {
  int64_t heads, kv_heads, group, head_dim, block_size, kv_block, kv_side, kv_slot, kv_head_stride;
  int64_t q_token, q_head, table_stride;
};

// Ask for the K (or V) of a whole block, every KV head, ahead of its use: the blocks of a
// context are scattered over the cache, where the hardware prefetchers do not follow.
template <typename T>
inline void prefetch_block(const T* side, const DecodeGeometry& geo) {
  const char* first = reinterpret_cast<const char*>(side);
  const int64_t bytes = geo.block_size * geo.kv_slot * static_cast<int64_t>(sizeof(T));
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(first + offset, 0, 3);
}

// exp(x) for x <= 0 (a score minus its row's maximum), in a form the compiler vectorizes
// (std::exp is a scalar call): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its Taylor
// series to r^7 (truncation error under 1e-8, below fp32's rounding), times 2^n.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // exp(-87) is ~1.6e-38, still a normal float
  const float n = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln 2 in two parts
  float p = 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One partition for every query head: its scores (`scores`, a row of `part_tokens` per
// head), then per head the softmax statistics (`maxes`, `sums`) and the weighted V sum
// (`accs`, head_dim per head). `q` holds the query heads in fp32, scaled. With the head
// size and the group (query heads per KV head) known at compile time, each K or V row is
// converted to fp32 once for its whole group and a group's V sums stay in registers.
template <int64_t kDim, int64_t kGroup, typename T>
void attend_partition(const Partition& part, const DecodeGeometry& geo, const float* q, const T* kv_base,
                      const int32_t* table, int64_t seq_len, int64_t part_tokens, float* scores,
                      float* maxes, float* sums, float* accs) {
  constexpr bool kUnrolled = kDim > 0 && kGroup > 0;
  const int64_t head_dim = kDim > 0 ? kDim : geo.head_dim, group = kGroup > 0 ? kGroup : geo.group;
  const int64_t bs = geo.block_size;
  const int64_t n = std::min(part.end_block * bs, seq_len) - part.first_block * bs;
  for (int64_t b = part.first_block; b < part.end_block; ++b) {
    const int64_t i0 = (b - part.first_block) * bs, rows = std::min(bs, n - i0);
    const T* k_block = kv_base + table[b] * geo.kv_block;
    if (b + 1 < part.end_block) prefetch_block(kv_base + table[b + 1] * geo.kv_block, geo);
    for (int64_t kvh = 0; kvh < geo.kv_heads; ++kvh) {
      const T* k = k_block + kvh * geo.kv_head_stride;
      const float* q_group = q + kvh * group * head_dim;
      float* row = scores + kvh * group * part_tokens + i0;
      for (int64_t slot = 0; slot < rows; ++slot, k += geo.kv_slot) {
        if constexpr (kUnrolled) {
          float kf[kDim];
          for (int64_t d = 0; d < kDim; ++d) kf[d] = to_float(k[d]);
          for (int64_t g = 0; g < kGroup; ++g) row[g * part_tokens + slot] = dot<kDim>(q_group + g * kDim, kf, kDim);
        } else {
          for (int64_t g = 0; g < group; ++g) {
            row[g * part_tokens + slot] = dot<kDim>(q_group + g * head_dim, k, head_dim);
          }
        }
      }
    }
  }
  for (int64_t h = 0; h < geo.heads; ++h) {
    float* row = scores + h * part_tokens;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n; ++i) m = std::max(m, row[i]);
    float sum = 0.f;
    for (int64_t i = 0; i < n; ++i) {
      row[i] = exp_nonpositive(row[i] - m);
      sum += row[i];
    }
    maxes[h] = m;
    sums[h] = sum;
  }
  std::fill(accs, accs + geo.heads * head_dim, 0.f);
  for (int64_t b = part.first_block; b < part.end_block; ++b) {
    const int64_t i0 = (b - part.first_block) * bs, rows = std::min(bs, n - i0);
    const T* v_block = kv_base + table[b] * geo.kv_block + geo.kv_side;
    if (b + 1 < part.end_block) prefetch_block(kv_base + table[b + 1] * geo.kv_block + geo.kv_side, geo);
    for (int64_t kvh = 0; kvh < geo.kv_heads; ++kvh) {
      const float* weights = scores + kvh * group * part_tokens + i0;
      float* acc_out = accs + kvh * group * head_dim;
      const T* v = v_block + kvh * geo.kv_head_stride;
      if constexpr (kUnrolled) {
        float acc[kGroup][kDim];
        std::memcpy(acc, acc_out, sizeof(acc));
        for (int64_t slot = 0; slot < rows; ++slot, v += geo.kv_slot) {
          float vf[kDim];
          for (int64_t d = 0; d < kDim; ++d) vf[d] = to_float(v[d]);
          for (int64_t g = 0; g < kGroup; ++g) {
            const float w = weights[g * part_tokens + slot];
            for (int64_t d = 0; d < kDim; ++d) acc[g][d] += w * vf[d];
          }
        }
        std::memcpy(acc_out, acc, sizeof(acc));
      } else {
        for (int64_t slot = 0; slot < rows; ++slot, v += geo.kv_slot) {
          for (int64_t g = 0; g < group; ++g) axpy<kDim>(acc_out + g * head_dim, weights[g * part_tokens + slot], v, head_dim);
        }
      }
    }
  }
}

template <int64_t kDim, int64_t kGroup, typename T>
void decode_attention_kernel(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_layer,
                             const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                             const at::Tensor& block_tables, double scale) {
  const int64_t num_seqs = seq_lens.size(0), heads = query.size(1), kv_heads = kv_layer.size(3);
  const DecodeGeometry geo{
      heads, kv_heads, heads / kv_heads, query.size(2), kv_layer.size(2), kv_layer.stride(0), kv_layer.stride(1),
      kv_layer.stride(2), kv_layer.stride(3), query.stride(0), query.stride(1), block_tables.stride(0)};
  const int64_t head_dim = geo.head_dim;
  const int64_t blocks_per_part = std::max<int64_t>(1, kPartitionTokens / geo.block_size);
  const int64_t part_tokens = blocks_per_part * geo.block_size;
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();

  std::vector<Partition> parts;
  std::vector<int64_t> first_part;  // per decoding sequence: its first partition
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (starts[s + 1] - starts[s] != 1) continue;  // prefill rows: not this kernel's
    first_part.push_back(static_cast<int64_t>(parts.size()));
    const int64_t blocks = (lens[s] + geo.block_size - 1) / geo.block_size;
    for (int64_t b = 0; b < blocks; b += blocks_per_part) parts.push_back({s, b, std::min(b + blocks_per_part, blocks)});
  }
  first_part.push_back(static_cast<int64_t>(parts.size()));
  const int64_t num_parts = static_cast<int64_t>(parts.size());
  if (num_parts == 0) return;

  // Per partition and query head: max score, softmax sum, weighted V sum.
  std::vector<float> maxes(num_parts * heads), sums(num_parts * heads), accs(num_parts * heads * head_dim);
  const T* q_base = query.data_ptr<T>();
  const T* kv_base = kv_layer.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, num_parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(heads * head_dim), scores(heads * part_tokens);
    for (int64_t p = begin; p < end; ++p) {
      const Partition& part = parts[p];
      const T* q_row = q_base + starts[part.seq] * geo.q_token;
      for (int64_t h = 0; h < heads; ++h) {
        for (int64_t d = 0; d < head_dim; ++d) q[h * head_dim + d] = to_float(q_row[h * geo.q_head + d]) * fscale;
      }
      attend_partition<kDim, kGroup>(part, geo, q.data(), kv_base, tables + part.seq * geo.table_stride, lens[part.seq],
                             part_tokens, scores.data(), &maxes[p * heads], &sums[p * heads],
                             &accs[p * heads * head_dim]);
    }
  });

  // Merge each sequence's partitions, weighting each by its share of the softmax mass.
  T* out_base = out.data_ptr<T>();
  const int64_t out_token = out.stride(0), out_head = out.stride(1);
  const int64_t num_decodes = static_cast<int64_t>(first_part.size()) - 1;
  at::parallel_for(0, num_decodes, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(head_dim);
    for (int64_t u = begin; u < end; ++u) {
      const int64_t p0 = first_part[u], p1 = first_part[u + 1];
      T* out_row = out_base + starts[parts[p0].seq] * out_token;
      for (int64_t h = 0; h < heads; ++h) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t p = p0; p < p1; ++p) m = std::max(m, maxes[p * heads + h]);
        std::fill(merged.begin(), merged.end(), 0.f);
        float total = 0.f;
        for (int64_t p = p0; p < p1; ++p) {
          const float w = exp_nonpositive(maxes[p * heads + h] - m);
          total += w * sums[p * heads + h];
          axpy<0>(merged.data(), w, &accs[(p * heads + h) * head_dim], head_dim);
        }
        const float inv = 1.f / total;
        for (int64_t d = 0; d < head_dim; ++d) out_row[h * out_head + d] = from_float<T>(merged[d] * inv);
      }
    }
  });
}

// The kernel for this head size and group: the common ones unrolled at compile time.
template <int64_t kDim, typename T>
void dispatch_group(int64_t group, at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_layer,
                    const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                    const at::Tensor& block_tables, double scale) {
#define KVTIER_GROUP_CASE(G) \
  case G:                    \
    return decode_attention_kernel<kDim, G, T>(out, query, kv_layer, query_start_loc, seq_lens, block_tables, scale);
  switch (group) {
    KVTIER_GROUP_CASE(1)
    KVTIER_GROUP_CASE(2)
    KVTIER_GROUP_CASE(3)
    KVTIER_GROUP_CASE(4)
    KVTIER_GROUP_CASE(6)
    KVTIER_GROUP_CASE(7)
    KVTIER_GROUP_CASE(8)
    default:
      return decode_attention_kernel<kDim, 0, T>(out, query, kv_layer, query_start_loc, seq_lens, block_tables, scale);
  }
#undef KVTIER_GROUP_CASE
}

template <typename T>
void dispatch_decode_attention(at::Tensor& out, const at::Tensor& query, const at::Tensor& kv_layer,
                               const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                               const at::Tensor& block_tables, double scale) {
  const int64_t group = query.size(1) / kv_layer.size(3);
  switch (query.size(2)) {
    case 64:
      return dispatch_group<64, T>(group, out, query, kv_layer, query_start_loc, seq_lens, block_tables, scale);
    case 128:
      return dispatch_group<128, T>(group, out, query, kv_layer, query_start_loc, seq_lens, block_tables, scale);
    default:
      return decode_attention_kernel<0, 0, T>(out, query, kv_layer, query_start_loc, seq_lens, block_tables, scale);
  }
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

void decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& kv_layer,
                      const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                      const at::Tensor& block_tables, double scale) {
  for (const at::Tensor& t : {out, query, kv_layer, query_start_loc, seq_lens, block_tables}) check_cpu(t, "every input");
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out must be [tokens, heads, head_dim]");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2 && kv_layer.size(4) == query.size(2),
              "kv_layer must be [blocks, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(query.size(1) % kv_layer.size(3) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && kv_layer.stride(4) == 1,
              "the head_dim of query, out and kv_layer must be contiguous");
  TORCH_CHECK(query.scalar_type() == kv_layer.scalar_type() && out.scalar_type() == kv_layer.scalar_type(),
              "query, out and kv_layer must share a dtype");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1,
              "query_start_loc, seq_lens and block_tables must be int32 (block_tables row-major)");
  TORCH_CHECK(query_start_loc.is_contiguous() && seq_lens.is_contiguous(), "lengths must be contiguous");
  KVTIER_DISPATCH_MODEL_TYPES(kv_layer.scalar_type(), "decode_attention", [&] {
    dispatch_decode_attention<scalar_t>(out, query, kv_layer, query_start_loc, seq_lens, block_tables, scale);
  });
}

// dst[d] = src[d], or +0 where src[d] is NaN or infinite (all exponent bits set), on the
// raw bits so that the loop vectorizes.
template <typename Bits, Bits kExponent>
inline void copy_finite_bits(const void* src, void* dst, int64_t n) {
  const Bits* from = static_cast<const Bits*>(src);
  Bits* to = static_cast<Bits*>(dst);
  for (int64_t d = 0; d < n; ++d) to[d] = (from[d] & kExponent) == kExponent ? Bits(0) : from[d];
}
inline void copy_finite(const float* src, float* dst, int64_t n) {
  copy_finite_bits<uint32_t, 0x7f800000u>(src, dst, n);
}
inline void copy_finite(const c10::BFloat16* src, c10::BFloat16* dst, int64_t n) {
  copy_finite_bits<uint16_t, 0x7f80u>(src, dst, n);
}
inline void copy_finite(const c10::Half* src, c10::Half* dst, int64_t n) {
  copy_finite_bits<uint16_t, 0x7c00u>(src, dst, n);
}

template <typename T>
void write_kv_kernel(at::Tensor& kv_layer, const at::Tensor& key, const at::Tensor& value,
                     const at::Tensor& slot_mapping) {
  const int64_t tokens = key.size(0), kv_heads = key.size(1), head_dim = key.size(2);
  const int64_t block_size = kv_layer.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  T* kv_base = kv_layer.data_ptr<T>();
  const int64_t kv_block = kv_layer.stride(0), kv_side = kv_layer.stride(1);
  const int64_t kv_slot = kv_layer.stride(2), kv_head_stride = kv_layer.stride(3);
  const T* sources[2] = {key.data_ptr<T>(), value.data_ptr<T>()};
  const int64_t token_strides[2] = {key.stride(0), value.stride(0)};
  const int64_t head_strides[2] = {key.stride(1), value.stride(1)};
  at::parallel_for(0, tokens, 256, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      T* slot_base = kv_base + (slot / block_size) * kv_block + (slot % block_size) * kv_slot;
      for (int64_t side = 0; side < 2; ++side) {
        const T* from = sources[side] + t * token_strides[side];
        T* to = slot_base + side * kv_side;
        for (int64_t h = 0; h < kv_heads; ++h) {
          const T* src = from + h * head_strides[side];
          T* dst = to + h * kv_head_stride;
          copy_finite(src, dst, head_dim);
        }
      }
    }
  });
}

void write_kv(at::Tensor kv_layer, const at::Tensor& key, const at::Tensor& value,
              const at::Tensor& slot_mapping) {
  for (const at::Tensor& t : {kv_layer, key, value, slot_mapping}) check_cpu(t, "every input");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(1) == 2, "kv_layer must be [blocks, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes() && key.size(1) == kv_layer.size(3) &&
                  key.size(2) == kv_layer.size(4),
              "key and value must be [tokens, kv_heads, head_dim] of the cache's geometry");
  TORCH_CHECK(key.scalar_type() == kv_layer.scalar_type() && value.scalar_type() == kv_layer.scalar_type(),
              "key, value and kv_layer must share a dtype");
  TORCH_CHECK(key.stride(2) == 1 && value.stride(2) == 1 && kv_layer.stride(4) == 1,
              "the head_dim of key, value and kv_layer must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping must be int64 with one slot per token");
  KVTIER_DISPATCH_MODEL_TYPES(kv_layer.scalar_type(), "write_kv", [&] {
    write_kv_kernel<scalar_t>(kv_layer, key, value, slot_mapping);
  });
}

template <typename T>
void rms_norm_kernel(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t rows = x.size(0), size = x.size(1);
  const T* x_base = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* out_base = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x_base + r * x.stride(0);
      float lanes[kLanes] = {0.f};
      int64_t d = 0;
      for (; d + kLanes <= size; d += kLanes) {
        for (int64_t j = 0; j < kLanes; ++j) {
          const float v = to_float(row[d + j]);
          lanes[j] += v * v;
        }
      }
      float sum = 0.f;
      for (int64_t j = 0; j < kLanes; ++j) sum += lanes[j];
      for (; d < size; ++d) sum += to_float(row[d]) * to_float(row[d]);
      const float inv = 1.f / std::sqrt(sum / static_cast<float>(size) + feps);
      T* o = out_base + r * out.stride(0);
      // As transformers: normalise in fp32, round to the model's dtype, then scale.
      for (int64_t i = 0; i < size; ++i) {
        const T normed = from_float<T>(to_float(row[i]) * inv);
        o[i] = from_float<T>(to_float(normed) * to_float(w[i]));
      }
    }
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [rows, size] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [size] of x's dtype");
  at::Tensor out = at::empty(x.sizes(), x.options());
  KVTIER_DISPATCH_MODEL_TYPES(x.scalar_type(), "rms_norm", [&] {
    rms_norm_kernel<scalar_t>(out, x, weight, eps);
  });
  return out;
}

// dsts[i] = srcs[i] for byte-sized runs, the whole batch split evenly over the threads in
// pieces of at least kCopyGrain bytes (one thread alone copies at about half the memory
// bandwidth two reach).
constexpr int64_t kCopyGrain = 1 << 20;

void copy_runs(at::TensorList dsts, at::TensorList srcs) {
  TORCH_CHECK(dsts.size() == srcs.size(), "copy_runs needs one source per destination");
  std::vector<char*> to;
  std::vector<const char*> from;
  std::vector<int64_t> starts, ends;  // each run's first and end byte in the batch
  int64_t total = 0;
  for (size_t i = 0; i < dsts.size(); ++i) {
    const at::Tensor& dst = dsts[i];
    const at::Tensor& src = srcs[i];
    check_cpu(dst, "every destination");
    check_cpu(src, "every source");
    TORCH_CHECK(dst.is_contiguous() && src.is_contiguous() && dst.nbytes() == src.nbytes(),
                "copy_runs copies contiguous tensors of equal sizes");
    to.push_back(static_cast<char*>(dst.data_ptr()));
    from.push_back(static_cast<const char*>(src.data_ptr()));
    starts.push_back(total);
    total += static_cast<int64_t>(dst.nbytes());
    ends.push_back(total);
  }
  at::parallel_for(0, total, kCopyGrain, [&](int64_t begin, int64_t end) {
    size_t run = std::upper_bound(ends.begin(), ends.end(), begin) - ends.begin();
    for (int64_t at = begin; at < end; ++run) {
      const int64_t stop = std::min(end, ends[run]), offset = at - starts[run];
      std::memcpy(to[run] + offset, from[run] + offset, static_cast<size_t>(stop - at));
      at = stop;
    }
  });
}

// out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for the few rows m of x. A decode step's
// product is a pass over the weight (the rows of x stay in L1), so its speed is the
// memory bandwidth one sequential read per thread reaches; the BLAS GEMM path reaches
// about half of it at one row.
constexpr int64_t kSkinnyGrainBytes = 64 << 10;  // weight bytes per unit of parallel work

template <typename T>
void skinny_linear_kernel(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias) {
  const int64_t rows = x.size(0), in = x.size(1), outs = weight.size(0);
  const at::Tensor x32 = x.to(at::kFloat).contiguous();
  const float* xs = x32.data_ptr<float>();
  const T* w = weight.data_ptr<T>();
  const T* b = bias.has_value() ? bias->data_ptr<T>() : nullptr;
  T* o = out.data_ptr<T>();
  const int64_t grain = std::max<int64_t>(1, kSkinnyGrainBytes / (in * static_cast<int64_t>(sizeof(T))));
  at::parallel_for(0, outs, grain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const T* row = w + n * in;
      const float offset = b ? to_float(b[n]) : 0.f;
      for (int64_t m = 0; m < rows; ++m) {
        o[m * outs + n] = from_float<T>(dot<0>(xs + m * in, row, in) + offset);
      }
    }
  });
}

at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "skinny_linear takes x [rows, in] and weight [out, in]");
  TORCH_CHECK(weight.is_contiguous() && x.scalar_type() == weight.scalar_type(),
              "skinny_linear needs a contiguous weight of x's dtype");
  if (bias.has_value()) {
    check_cpu(*bias, "bias");
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == weight.size(0) &&
                    bias->scalar_type() == weight.scalar_type(),
                "skinny_linear needs a contiguous bias of the weight's dtype, one per output");
  }
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  KVTIER_DISPATCH_MODEL_TYPES(x.scalar_type(), "skinny_linear", [&] {
    skinny_linear_kernel<scalar_t>(out, x, weight, bias);
  });
  return out;
}

// Structured outputs: logits[rows[i], t] = -inf where bit t of bitmask[i] is clear (tokens
// past the bitmask's width too). Words are tested whole first: grammar masks are mostly
// runs of all-allowed or all-refused words, so a row costs about one pass over its words.
template <typename T>
void apply_token_bitmask_kernel(at::Tensor& logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  const int64_t vocab = logits.size(1), row_stride = logits.stride(0), words = bitmask.size(1);
  const T refused = static_cast<T>(-std::numeric_limits<float>::infinity());
  T* base = logits.data_ptr<T>();
  const uint32_t* bits = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* row = base + row_ids[i] * row_stride;
      const uint32_t* row_bits = bits + i * words;
      for (int64_t w = 0; w < words && w * 32 < vocab; ++w) {
        const uint32_t word = row_bits[w];
        const int64_t first = w * 32, count = std::min<int64_t>(32, vocab - first);
        T* out = row + first;
        if (word == 0xFFFFFFFFu) continue;
        if (word == 0) {
          std::fill_n(out, count, refused);
          continue;
        }
        for (int64_t b = 0; b < count; ++b) {  // a select, not a branch: mixed words are random
          out[b] = ((word >> b) & 1u) ? out[b] : refused;
        }
      }
      for (int64_t t = words * 32; t < vocab; ++t) row[t] = refused;
    }
  });
}

void apply_token_bitmask(at::Tensor logits, const at::Tensor& bitmask, const at::Tensor& rows) {
  check_cpu(logits, "logits");
  check_cpu(bitmask, "bitmask");
  check_cpu(rows, "rows");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [n, vocab] with contiguous rows");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.is_contiguous() && bitmask.scalar_type() == at::kInt,
              "bitmask must be a contiguous int32 [rows, words]");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.size(0) == bitmask.size(0),
              "rows must be int64, one per bitmask row");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "apply_token_bitmask",
                                  [&] { apply_token_bitmask_kernel<scalar_t>(logits, bitmask, rows); });
}

}  // namespace

TORCH_LIBRARY(kvtier_cpu, m) {
  m.def("decode_attention(Tensor(a!) out, Tensor query, Tensor kv_layer, Tensor query_start_loc, "
        "Tensor seq_lens, Tensor block_tables, float scale) -> ()");
  m.def("write_kv(Tensor(a!) kv_layer, Tensor key, Tensor value, Tensor slot_mapping) -> ()");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("copy_runs(Tensor(a!)[] dsts, Tensor[] srcs) -> ()");
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask, Tensor rows) -> ()");
  m.def("skinny_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvtier_cpu, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("write_kv", &write_kv);
  m.impl("rms_norm", &rms_norm);
  m.impl("copy_runs", &copy_runs);
  m.impl("apply_token_bitmask", &apply_token_bitmask);
  m.impl("skinny_linear", &skinny_linear);
}
