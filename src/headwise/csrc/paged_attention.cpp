// Paged attention on the CPU: each (sequence, kv head, tile of query rows) reads its keys and
// values through the block table, page by page, with no gathered copy.
//
// Legend: B sequences, H query heads, Hkv kv heads, G = H / Hkv, T new queries per sequence,
// N pages, P page size, L a sequence's keys, D head dim of q and k, Dv of v.
//
// The reduction order is fixed by absolute key positions and nothing else (issue 37): keys
// are reduced in blocks of KEY_BLOCK keys at offsets 0, 32, 64, ... counted from the
// sequence's position 0, whatever the page size, the pages' order, the batch or the threads;
// the blocks are merged in key order by an online softmax. Every score and every update of a
// row is made by the same instructions whatever its position: a block's scores, exps and sums
// run over all KEY_BLOCK lanes (past the row's last key: -inf scores, zero weights, no read),
// with no remainder loop. A row's result is a function of its query, its keys by position,
// L, T and its own position only; compiled without -ffast-math and without FMA contraction,
// so a vectorised lane and a scalar one give the same bits.
//
// The address of key j of sequence b, kv head h is
//     pool + table[b, j / P] * s_n + h * s_h + (j % P) * s_p   (+ d * s_d)
// so a contiguous (B, Hkv, Sk, D) cache is the pool of B pages of Sk keys with table[b] = [b].
//
// Optional per-sequence placement (the batch-invariant mode's padded and packed layouts): key j
// of sequence b lies at position key_offset[b] + j of its pages (left padding: the first real
// key), and query row t sits at key position query_pos[b] + t (default L - T, bottom-right);
// or, with row_end (B, T), query t attends keys 0 .. row_end[b, t] - 1 (a mask of runs).
// Blocks stay at offsets 0, 32, ... of the sequence's own keys, so the padding around it
// changes no bit. A row that may attend no key outputs zeros with lse -inf (the contract).
//
// attention_backward: the input gradients of the same attention, again in a fixed order
// (dq: each row's keys in key order; dk, dv: each key's rows in row order), so a row's
// gradient does not depend on the batch either. Contiguous pools only (table[b] = [b]).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr int64_t KEY_BLOCK = 32;  // keys reduced together; fixed: never derived from P, L or the batch
constexpr int64_t ROW_TILE = 64;   // query rows of one task (the rows of a task are independent)
constexpr int LANES = 16;          // partial sums of a dot product, added in a fixed tree
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

// exp(x) for x <= 0 (or NaN, which stays NaN): Cephes' expf polynomial, about 1 ulp; written
// so that the compiler vectorises it over a block's lanes without changing a bit.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;  // exp(-87) ~ 1.6e-38: the smallest normal range, never a denormal
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round(x / ln 2)
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(float));
  return p * two_n;
}

// LANES floats as one value: GCC / Clang vector extensions, elementwise IEEE arithmetic (one
// zmm register with AVX-512, two ymm with AVX2), so the order of every sum is the code's.
typedef float Lanes __attribute__((vector_size(LANES * sizeof(float))));
typedef float Lanes8 __attribute__((vector_size(8 * sizeof(float))));
typedef float Lanes4 __attribute__((vector_size(4 * sizeof(float))));
typedef float Lanes2 __attribute__((vector_size(2 * sizeof(float))));
static_assert(LANES == 16, "dot's tree adds 16 lanes");

inline Lanes load(const float* p) {
  Lanes x;
  std::memcpy(&x, p, sizeof(Lanes));
  return x;
}

inline void store(float* p, Lanes x) { std::memcpy(p, &x, sizeof(Lanes)); }

// sum_d a[d] * b[d]: LANES partial sums, added in a fixed tree, then the D % LANES rest.
inline float dot(const float* a, const float* b, int64_t D) {
  Lanes acc = {};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES) acc += load(a + d) * load(b + d);
  // lanes l and l + w added, w = 8, 4, 2, 1
  const Lanes8 h8 = __builtin_shufflevector(acc, acc, 0, 1, 2, 3, 4, 5, 6, 7) +
                    __builtin_shufflevector(acc, acc, 8, 9, 10, 11, 12, 13, 14, 15);
  const Lanes4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
  const Lanes2 h2 = __builtin_shufflevector(h4, h4, 0, 1) + __builtin_shufflevector(h4, h4, 2, 3);
  float s = h2[0] + h2[1];
  for (; d < D; ++d) s += a[d] * b[d];
  return s;
}

// dot() of q with four keys at once: the same lane sums and the same tree for each key (its
// levels run on the four keys' lanes packed together), so each result has dot()'s bits.
inline void dot4(const float* q, const float* const* k, int64_t D, float* out) {
  Lanes a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t d = 0;
  for (; d + LANES <= D; d += LANES) {
    const Lanes x = load(q + d);
    a0 += x * load(k[0] + d), a1 += x * load(k[1] + d), a2 += x * load(k[2] + d), a3 += x * load(k[3] + d);
  }
  // w = 8: lanes l and l + 8 of each key; two keys a vector
  const Lanes b01 = __builtin_shufflevector(a0, a1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                    __builtin_shufflevector(a0, a1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const Lanes b23 = __builtin_shufflevector(a2, a3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                    __builtin_shufflevector(a2, a3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // w = 4: four lanes a key
  const Lanes c = __builtin_shufflevector(b01, b23, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                  __builtin_shufflevector(b01, b23, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  // w = 2, then w = 1
  const Lanes8 e = __builtin_shufflevector(c, c, 0, 1, 4, 5, 8, 9, 12, 13) +
                   __builtin_shufflevector(c, c, 2, 3, 6, 7, 10, 11, 14, 15);
  const Lanes4 f = __builtin_shufflevector(e, e, 0, 2, 4, 6) + __builtin_shufflevector(e, e, 1, 3, 5, 7);
  float s[4] = {f[0], f[1], f[2], f[3]};
  for (; d < D; ++d)
    for (int i = 0; i < 4; ++i) s[i] += q[d] * k[i][d];
  std::memcpy(out, s, sizeof(s));
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// Where one pool's keys (or values) live: element strides of the (N, Hkv, P, D) pool.
template <typename scalar_t>
struct Pool {
  const scalar_t* data;
  int64_t s_n, s_h, s_p, s_d, P, D;

  const scalar_t* at(const int64_t* pages, int64_t h, int64_t page, int64_t slot) const {
    return data + pages[page] * s_n + h * s_h + slot * s_p;
  }

  // Ask the memory for keys j0 .. j0 + count - 1 ahead of their block (a hint: no value changes).
  void prefetch(const int64_t* pages, int64_t h, int64_t j0, int64_t count) const {
    int64_t page = j0 / P, slot = j0 % P;
    const int64_t bytes = D * s_d * static_cast<int64_t>(sizeof(scalar_t));
    for (int64_t j = 0; j < count; ++j, ++slot) {
      if (slot == P) slot = 0, ++page;
      const char* src = reinterpret_cast<const char*>(at(pages, h, page, slot));
      for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(src + byte);
    }
  }

  // Float pointers to keys j0 .. j0 + count - 1: the pool itself where it holds contiguous
  // fp32 rows, else a float copy in ``tile`` (KEY_BLOCK x D). The values are the same.
  void block(const int64_t* pages, int64_t h, int64_t j0, int64_t count, float* tile, const float** rows) const {
    int64_t page = j0 / P, slot = j0 % P;  // one division a block; the slots follow
    for (int64_t j = 0; j < count; ++j, ++slot) {
      if (slot == P) slot = 0, ++page;
      const scalar_t* src = at(pages, h, page, slot);
      if constexpr (std::is_same_v<scalar_t, float>) {
        if (s_d == 1) {
          rows[j] = src;
          continue;
        }
      }
      float* dst = tile + j * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = to_float(src[d * s_d]);
      rows[j] = dst;
    }
  }
};

struct Task {
  int64_t b, h, r0, r1, cost;
};

// One query row's online-softmax state: running max, sum of weights, unnormalised output.
struct Row {
  float* m;
  float* l;
  float* acc;
};

// For each of R rows: acc = acc * alpha + p[0] v[0] + p[1] v[1] + ... (in this order for every
// element, whatever R), over the live keys only: a key past the rows' last is never read, so NaN
// there cannot leak. C x LANES elements at a time, kept in registers across the keys (R x C
// independent sums, so that the adds of one key do not wait on each other); each value row is
// loaded once for the R rows (the query heads of one kv head at one position).
template <int R, int C>
inline void add_value_lanes(float* const* acc, const float* alpha, const float (*p)[KEY_BLOCK],
                            const float* const* values, int64_t live, int64_t d0) {
  Lanes a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) a[r][c] = load(acc[r] + d0 + c * LANES) * alpha[r];
  for (int64_t j = 0; j < live; ++j)
    for (int c = 0; c < C; ++c) {
      const Lanes v = load(values[j] + d0 + c * LANES);
      for (int r = 0; r < R; ++r) a[r][c] += p[r][j] * v;
    }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store(acc[r] + d0 + c * LANES, a[r][c]);
}

template <int R>
inline void add_values(float* const* acc, const float* alpha, const float (*p)[KEY_BLOCK],
                       const float* const* values, int64_t live, int64_t Dv) {
  constexpr int C = R <= 2 ? 4 : 2;  // R x C <= 8 sums: registers with AVX-512 (a zmm each) and AVX2 (two ymm)
  int64_t d0 = 0;
  for (; d0 + C * LANES <= Dv; d0 += C * LANES) add_value_lanes<R, C>(acc, alpha, p, values, live, d0);
  for (; d0 + LANES <= Dv; d0 += LANES) add_value_lanes<R, 1>(acc, alpha, p, values, live, d0);
  for (; d0 < Dv; ++d0)
    for (int r = 0; r < R; ++r) {
      float a = acc[r][d0] * alpha[r];
      for (int64_t j = 0; j < live; ++j) a += p[r][j] * values[j][d0];
      acc[r][d0] = a;
    }
}

// The scores of one block of keys (live: the first ``live`` of KEY_BLOCK) for one row, its
// weights ``p`` (zero past ``live``), and the row's new max and sum; returns the factor
// alpha = exp(m_old - m_new) its output is to be scaled by before the block's values add.
inline float softmax_block(const float* q, const float* const* keys, int64_t live, float scale, int64_t D, Row row,
                           float* p) {
  float s[KEY_BLOCK];
  int64_t j = 0;
  for (; j + 4 <= live; j += 4) dot4(q, keys + j, D, s + j);
  for (; j < live; ++j) s[j] = dot(q, keys[j], D);
  for (j = 0; j < KEY_BLOCK; ++j) s[j] = j < live ? s[j] * scale : NEG_INF;
  float top[KEY_BLOCK];
  std::memcpy(top, s, sizeof(s));
  for (int64_t w = KEY_BLOCK / 2; w > 0; w /= 2)
    for (int64_t i = 0; i < w; ++i) top[i] = top[i] < top[i + w] ? top[i + w] : top[i];
  const float m_old = *row.m;
  const float m_new = m_old < top[0] ? top[0] : m_old;
  const float alpha = m_old == NEG_INF ? 0.0f : exp_nonpositive(m_old - m_new);
  for (j = 0; j < KEY_BLOCK; ++j) p[j] = exp_nonpositive(s[j] - m_new);
  for (j = 0; j < KEY_BLOCK; ++j) p[j] = j < live ? p[j] : 0.0f;
  float sum[KEY_BLOCK];
  std::memcpy(sum, p, sizeof(sum));
  for (int64_t w = KEY_BLOCK / 2; w > 0; w /= 2)
    for (int64_t i = 0; i < w; ++i) sum[i] += sum[i + w];
  *row.l = *row.l * alpha + sum[0];
  *row.m = m_new;
  return alpha;
}

constexpr int VALUE_ROWS = 4;  // rows whose values one pass over a block's value rows adds

// Fold one block of keys into rows i .. i + R - 1 of a task (R <= VALUE_ROWS), which see the
// same ``live`` keys of it.
inline void fold_rows(const float* q, int64_t D, int64_t Dv, float scale, const float* const* keys,
                      const float* const* values, int64_t live, int R, float* m, float* l, float* acc) {
  float p[VALUE_ROWS][KEY_BLOCK];
  float alpha[VALUE_ROWS];
  float* accs[VALUE_ROWS];
  for (int r = 0; r < R; ++r) {
    alpha[r] = softmax_block(q + r * D, keys, live, scale, D, Row{m + r, l + r, acc + r * Dv}, p[r]);
    accs[r] = acc + r * Dv;
  }
  switch (R) {
    case 1: add_values<1>(accs, alpha, p, values, live, Dv); break;
    case 2: add_values<2>(accs, alpha, p, values, live, Dv); break;
    case 3: add_values<3>(accs, alpha, p, values, live, Dv); break;
    default: add_values<4>(accs, alpha, p, values, live, Dv); break;
  }
}

struct Problem {
  int64_t B, H, Hkv, G, T, D, Dv, W, start;
  float scale;
  bool causal;
  const int64_t* table;
  const int64_t* lens;
  const int64_t* key_offset;  // (B,) or null: 0
  const int64_t* query_pos;   // (B,) or null: L - T
  const int64_t* row_end;     // (B, T) or null: each query's keys 0 .. row_end - 1 (then ``causal`` is not read)

  int64_t offset(int64_t b) const { return key_offset ? key_offset[b] : 0; }

  // The keys row r of sequence b may attend: 0 .. end - 1 (its own L when not causal).
  int64_t end(int64_t b, int64_t r) const {
    const int64_t L = lens[b];
    if (row_end) return std::min(L, std::max<int64_t>(row_end[b * T + r / G], 0));
    if (!causal) return L;
    const int64_t e = (query_pos ? query_pos[b] : L - T) + r / G + 1;
    return std::min(L, std::max<int64_t>(e, 0));
  }
};

struct Buffers {
  std::vector<float> q, m, l, acc, k_tile, v_tile;
  Buffers(int64_t D, int64_t Dv)
      : q(ROW_TILE * D), m(ROW_TILE), l(ROW_TILE), acc(ROW_TILE * Dv), k_tile(KEY_BLOCK * D),
        v_tile(KEY_BLOCK * Dv) {}
};

// Row r of a (sequence, kv head) is query t = r / G of head h * G + r % G: its index in (B, H, T).
inline int64_t row_index(const Problem& pr, const Task& task, int64_t r) {
  return (task.b * pr.H + task.h * pr.G + r % pr.G) * pr.T + r / pr.G;
}

template <typename scalar_t>
void run_task(const Problem& pr, const Task& task, const scalar_t* q, const Pool<scalar_t>& kp,
              const Pool<scalar_t>& vp, const float* state_in[3], float* state_out[3], scalar_t* out, float* lse,
              Buffers& buf) {
  const int64_t n = task.r1 - task.r0, D = pr.D, Dv = pr.Dv, off = pr.offset(task.b);
  const int64_t* pages = pr.table + task.b * pr.W;
  int64_t last = 0;  // the last key any row of the task sees
  std::vector<int64_t> end(n);  // each row's keys: 0 .. end - 1
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = task.r0 + i, at = row_index(pr, task, r);
    end[i] = pr.end(task.b, r);
    last = std::max(last, end[i]);
    for (int64_t d = 0; d < D; ++d) buf.q[i * D + d] = to_float(q[at * D + d]);
    buf.m[i] = state_in[0] ? state_in[0][at] : NEG_INF;
    buf.l[i] = state_in[1] ? state_in[1][at] : 0.0f;
    for (int64_t d = 0; d < Dv; ++d) buf.acc[i * Dv + d] = state_in[2] ? state_in[2][at * Dv + d] : 0.0f;
  }
  const float* keys[KEY_BLOCK];
  const float* values[KEY_BLOCK];
  for (int64_t j0 = pr.start; j0 < last; j0 += KEY_BLOCK) {
    const int64_t count = std::min(KEY_BLOCK, last - j0);
    kp.block(pages, task.h, off + j0, count, buf.k_tile.data(), keys);
    vp.block(pages, task.h, off + j0, count, buf.v_tile.data(), values);
    if (j0 + KEY_BLOCK < last) {  // the next block's rows, read while this one computes
      const int64_t ahead = std::min(KEY_BLOCK, last - j0 - KEY_BLOCK);
      kp.prefetch(pages, task.h, off + j0 + KEY_BLOCK, ahead);
      vp.prefetch(pages, task.h, off + j0 + KEY_BLOCK, ahead);
    }
    for (int64_t i = 0; i < n;) {  // runs of up to VALUE_ROWS rows that see the same keys of the block
      const int64_t live = std::min(count, end[i] - j0);
      int R = 1;
      while (R < VALUE_ROWS && i + R < n && std::min(count, end[i + R] - j0) == live) ++R;
      if (live > 0)
        fold_rows(&buf.q[i * D], D, Dv, pr.scale, keys, values, live, R, &buf.m[i], &buf.l[i], &buf.acc[i * Dv]);
      i += R;
    }
  }
  for (int64_t i = 0; i < n; ++i) {
    const int64_t at = row_index(pr, task, task.r0 + i);
    if (state_out[0]) {
      state_out[0][at] = buf.m[i];
      state_out[1][at] = buf.l[i];
      std::memcpy(state_out[2] + at * Dv, &buf.acc[i * Dv], Dv * sizeof(float));
      continue;
    }
    const float l = buf.l[i];
    if (l == 0.0f) {  // no key: the contract's zero row
      for (int64_t d = 0; d < Dv; ++d) out[at * Dv + d] = static_cast<scalar_t>(0.0f);
      lse[at] = NEG_INF;
      continue;
    }
    for (int64_t d = 0; d < Dv; ++d) out[at * Dv + d] = static_cast<scalar_t>(buf.acc[i * Dv + d] / l);
    lse[at] = buf.m[i] + std::log(l);
  }
}

std::vector<Task> make_tasks(const Problem& pr) {
  std::vector<Task> tasks;
  const int64_t rows = pr.G * pr.T;
  for (int64_t b = 0; b < pr.B; ++b)
    for (int64_t h = 0; h < pr.Hkv; ++h)
      for (int64_t r0 = 0; r0 < rows; r0 += ROW_TILE) {
        const int64_t r1 = std::min(rows, r0 + ROW_TILE);
        tasks.push_back(Task{b, h, r0, r1, (r1 - r0) * std::max<int64_t>(pr.lens[b] - pr.start, 1)});
      }
  // Longest first, taken by whichever thread is free: balance for ragged batches. Which thread
  // runs a task changes no bit of its result.
  std::stable_sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) { return a.cost > b.cost; });
  return tasks;
}

template <typename scalar_t>
Pool<scalar_t> pool_of(const at::Tensor& t) {
  return Pool<scalar_t>{t.data_ptr<scalar_t>(), t.stride(0), t.stride(1), t.stride(2), t.stride(3), t.size(2),
                        t.size(3)};
}

template <typename scalar_t>
void run_all(const Problem& pr, const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
             const float* state_in[3], float* state_out[3], scalar_t* out, float* lse) {
  const std::vector<Task> tasks = make_tasks(pr);
  const auto kp = pool_of<scalar_t>(k_pool), vp = pool_of<scalar_t>(v_pool);
  const scalar_t* qd = q.data_ptr<scalar_t>();
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), static_cast<int64_t>(tasks.size()));
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(workers, 1), 1, [&](int64_t first, int64_t past) {
    for (int64_t w = first; w < past; ++w) {
      Buffers buf(pr.D, pr.Dv);
      for (int64_t i = next++; i < static_cast<int64_t>(tasks.size()); i = next++)
        run_task<scalar_t>(pr, tasks[i], qd, kp, vp, state_in, state_out, out, lse, buf);
    }
  });
}

const int64_t* placement(const c10::optional<at::Tensor>& t, int64_t B, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == B, name, " int64 (B,)");
  return t->data_ptr<int64_t>();
}

void check_inputs(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& table,
                  const at::Tensor& lens, int64_t start, const int64_t* key_offset, bool free_rows) {
  TORCH_CHECK(q.device().is_cpu() && k_pool.device().is_cpu() && v_pool.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 4 && k_pool.dim() == 4 && v_pool.dim() == 4, "q (B, H, T, D), pools (N, Hkv, P, D)");
  TORCH_CHECK(q.scalar_type() == k_pool.scalar_type() && q.scalar_type() == v_pool.scalar_type(), "one dtype");
  TORCH_CHECK(q.size(3) == k_pool.size(3) && k_pool.sizes().slice(0, 3) == v_pool.sizes().slice(0, 3), "shapes");
  TORCH_CHECK(k_pool.size(1) > 0 && q.size(1) % k_pool.size(1) == 0, "H % Hkv == 0");
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous() && table.dim() == 2, "table int64 (B, W)");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.numel() == q.size(0), "lens (B,)");
  TORCH_CHECK(table.size(0) == q.size(0) && start >= 0 && start % KEY_BLOCK == 0, "table rows, start");
  const int64_t N = k_pool.size(0), P = k_pool.size(2), W = table.size(1), T = q.size(2);
  const int64_t* t = table.data_ptr<int64_t>();
  const int64_t* n = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {
    const int64_t off = key_offset ? key_offset[b] : 0, used = off + n[b];  // positions read: off .. used - 1
    TORCH_CHECK((free_rows || n[b] >= T) && n[b] >= start && off >= 0 && (used + P - 1) / P <= W,
                "seq_lens[", b, "] = ", n[b], ", key_offset ", off);
    for (int64_t i = off / P; i < (used + P - 1) / P; ++i)
      TORCH_CHECK(t[b * W + i] >= 0 && t[b * W + i] < N, "block_table[", b, "] names page ", t[b * W + i]);
  }
}

}  // namespace

// out (B, H, T, Dv) in q's dtype and lse (B, H, T) fp32; or, with finalize=false, the state
// to continue from: acc (B, H, T, Dv), m (B, H, T), l (B, H, T), all fp32. ``start`` (a
// multiple of KEY_BLOCK): the first key read, the keys before it being the state passed in.
std::vector<at::Tensor> paged_attention(const at::Tensor& q_in, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                        const at::Tensor& table, const at::Tensor& lens, double scale, bool causal,
                                        int64_t start, const c10::optional<at::Tensor>& state_m,
                                        const c10::optional<at::Tensor>& state_l,
                                        const c10::optional<at::Tensor>& state_acc, bool finalize,
                                        const c10::optional<at::Tensor>& key_offset,
                                        const c10::optional<at::Tensor>& query_pos,
                                        const c10::optional<at::Tensor>& row_end) {
  const int64_t B = q_in.size(0);
  const int64_t* offsets = placement(key_offset, B, "key_offset");
  const int64_t* positions = placement(query_pos, B, "query_pos");
  const int64_t* ends = placement(row_end, B * q_in.size(2), "row_end");
  check_inputs(q_in, k_pool, v_pool, table, lens, start, offsets, positions || ends);
  const at::Tensor q = q_in.contiguous();
  const int64_t H = q.size(1), T = q.size(2), Hkv = k_pool.size(1), Dv = v_pool.size(3);
  const Problem pr{B, H, Hkv, H / Hkv, T, q.size(3), Dv, table.size(1), start, static_cast<float>(scale), causal,
                   table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), offsets, positions, ends};
  const auto f32 = q.options().dtype(at::kFloat);
  const float* state_in[3] = {nullptr, nullptr, nullptr};
  at::Tensor m_in, l_in, acc_in;
  if (state_m.has_value()) {
    m_in = state_m->to(at::kFloat).contiguous(), l_in = state_l->to(at::kFloat).contiguous();
    acc_in = state_acc->to(at::kFloat).contiguous();
    TORCH_CHECK(m_in.numel() == B * H * T && l_in.numel() == B * H * T && acc_in.numel() == B * H * T * Dv, "state");
    state_in[0] = m_in.data_ptr<float>(), state_in[1] = l_in.data_ptr<float>(), state_in[2] = acc_in.data_ptr<float>();
  }
  float* state_out[3] = {nullptr, nullptr, nullptr};
  std::vector<at::Tensor> result;
  if (finalize) {
    result = {at::empty({B, H, T, Dv}, q.options()), at::empty({B, H, T}, f32)};
  } else {
    result = {at::empty({B, H, T, Dv}, f32), at::empty({B, H, T}, f32), at::empty({B, H, T}, f32)};
    state_out[0] = result[1].data_ptr<float>(), state_out[1] = result[2].data_ptr<float>();
    state_out[2] = result[0].data_ptr<float>();
  }
  if (q.scalar_type() == at::kFloat) {
    run_all<float>(pr, q, k_pool, v_pool, state_in, state_out, finalize ? result[0].data_ptr<float>() : nullptr,
                   finalize ? result[1].data_ptr<float>() : nullptr);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "fp32 or bf16 only");
    run_all<c10::BFloat16>(pr, q, k_pool, v_pool, state_in, state_out,
                           finalize ? result[0].data_ptr<c10::BFloat16>() : nullptr,
                           finalize ? result[1].data_ptr<float>() : nullptr);
  }
  return result;
}

// The first entry b * W + i of a (B, W) int64 table among the pages the sequences read
// (i < ceil(lens[b] / P)) that names no page of a pool of N: -1 where every one does.
int64_t first_bad_page(const at::Tensor& table, const std::vector<int64_t>& lens, int64_t P, int64_t N) {
  TORCH_CHECK(table.scalar_type() == at::kLong && table.is_contiguous() && table.dim() == 2 &&
                  table.size(0) == static_cast<int64_t>(lens.size()) && P > 0, "table int64 (B, W), lens (B,)");
  const int64_t W = table.size(1);
  const int64_t* t = table.data_ptr<int64_t>();
  for (int64_t b = 0; b < table.size(0); ++b)
    for (int64_t i = 0; i < std::min(W, (lens[b] + P - 1) / P); ++i)
      if (t[b * W + i] < 0 || t[b * W + i] >= N) return b * W + i;
  return -1;
}

// --- the backward: input gradients in a fixed order -------------------------------------------

// Run fn(i) for i in 0 .. count - 1, each index taken by whichever thread is free (which thread
// runs an index changes no bit of its result).
template <typename Fn>
void for_each_task(int64_t count, const Fn& fn) {
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), count);
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::max<int64_t>(workers, 1), 1, [&](int64_t first, int64_t past) {
    for (int64_t w = first; w < past; ++w)
      for (int64_t i = next++; i < count; i = next++) fn(i);
  });
}

// Float copies of the backward's inputs, and where row r of (sequence b, kv head h) and key j lie.
struct Backward {
  Problem pr;
  int64_t Sk;
  const float *q, *k, *v, *dout, *lse, *delta;

  int64_t row(int64_t b, int64_t h, int64_t r) const { return (b * pr.H + h * pr.G + r % pr.G) * pr.T + r / pr.G; }
  int64_t key(int64_t b, int64_t h, int64_t j) const { return (b * pr.Hkv + h) * Sk + pr.offset(b) + j; }

  // The row's weight of key j and its score gradient: p = exp(s - lse), ds = p (dout . v_j - delta).
  inline void weight(int64_t at, int64_t kj, float& p, float& ds) const {
    const float s = dot(q + at * pr.D, k + kj * pr.D, pr.D) * pr.scale;
    p = exp_nonpositive(s - lse[at]);
    ds = p * (dot(dout + at * pr.Dv, v + kj * pr.Dv, pr.Dv) - delta[at]);
  }
};

// dq of rows r0 .. r1 - 1 of (b, h): each row's keys in key order.
void dq_task(const Backward& bw, int64_t b, int64_t h, int64_t r0, int64_t r1, float* dq) {
  const int64_t D = bw.pr.D;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t at = bw.row(b, h, r), e = bw.pr.end(b, r);
    float* acc = dq + at * D;  // zeroed by the caller: a row with no key keeps zeros
    for (int64_t j = 0; j < e; ++j) {
      float p, ds;
      const int64_t kj = bw.key(b, h, j);
      bw.weight(at, kj, p, ds);
      const float c = ds * bw.pr.scale;
      const float* kr = bw.k + kj * D;
      for (int64_t d = 0; d < D; ++d) acc[d] += c * kr[d];
    }
  }
}

// dk, dv of keys j0 .. j0 + KEY_BLOCK - 1 of (b, h): each key's rows in row order (query, then head).
void dkv_task(const Backward& bw, int64_t b, int64_t h, int64_t j0, float* dk, float* dv) {
  const int64_t D = bw.pr.D, Dv = bw.pr.Dv, count = std::min(KEY_BLOCK, bw.pr.lens[b] - j0);
  const int64_t rows = bw.pr.G * bw.pr.T;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t at = bw.row(b, h, r), live = std::min(count, bw.pr.end(b, r) - j0);
    const float* qr = bw.q + at * D;
    const float* dor = bw.dout + at * Dv;
    for (int64_t j = 0; j < live; ++j) {
      float p, ds;
      const int64_t kj = bw.key(b, h, j0 + j);
      bw.weight(at, kj, p, ds);
      const float c = ds * bw.pr.scale;
      float* dkr = dk + kj * D;
      float* dvr = dv + kj * Dv;
      for (int64_t d = 0; d < Dv; ++d) dvr[d] += p * dor[d];
      for (int64_t d = 0; d < D; ++d) dkr[d] += c * qr[d];
    }
  }
}

// (dq, dk, dv) in the inputs' dtype for attention over contiguous keys k, v (B, Hkv, Sk, D|Dv),
// placed as paged_attention places them (lens, key_offset, query_pos or row_end, causal). out and lse are
// the forward's; dout the output's gradient, dlse (or none) the lse's.
std::vector<at::Tensor> attention_backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                           const at::Tensor& out, const at::Tensor& dout, const at::Tensor& lse,
                                           const at::Tensor& lens, double scale, bool causal,
                                           const c10::optional<at::Tensor>& key_offset,
                                           const c10::optional<at::Tensor>& query_pos,
                                           const c10::optional<at::Tensor>& row_end,
                                           const c10::optional<at::Tensor>& dlse) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), Sk = k.size(2),
                Dv = v.size(3);
  const at::Tensor table = at::arange(B, lens.options()).view({B, 1});
  const int64_t* offsets = placement(key_offset, B, "key_offset");
  const int64_t* positions = placement(query_pos, B, "query_pos");
  const int64_t* ends = placement(row_end, B * T, "row_end");
  check_inputs(q, k, v, table, lens, 0, offsets, positions || ends);
  TORCH_CHECK(out.sizes() == dout.sizes() && out.size(3) == Dv && lse.numel() == B * H * T, "out, dout, lse");
  const auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  const at::Tensor qf = f32(q), kf = f32(k), vf = f32(v), of = f32(out), dof = f32(dout), lf = f32(lse);
  const at::Tensor delta = (dof * of).sum(-1).contiguous();  // overwritten below in a fixed order
  float* dl = delta.data_ptr<float>();
  const at::Tensor dlf = dlse.has_value() ? f32(*dlse) : at::Tensor();  // the lse's own gradient: ds += p dlse
  TORCH_CHECK(!dlf.defined() || dlf.numel() == B * H * T, "dlse (B, H, T)");
  for (int64_t i = 0; i < B * H * T; ++i) {
    dl[i] = dot(dof.data_ptr<float>() + i * Dv, of.data_ptr<float>() + i * Dv, Dv);
    if (dlf.defined()) dl[i] -= dlf.data_ptr<float>()[i];
  }
  const Problem pr{B, H, Hkv, H / Hkv, T, D, Dv, 1, 0, static_cast<float>(scale), causal,
                   table.data_ptr<int64_t>(), lens.data_ptr<int64_t>(), offsets, positions, ends};
  const Backward bw{pr, Sk, qf.data_ptr<float>(), kf.data_ptr<float>(), vf.data_ptr<float>(), dof.data_ptr<float>(),
                    lf.data_ptr<float>(), dl};
  at::Tensor dq = at::zeros_like(qf), dk = at::zeros_like(kf), dv = at::zeros_like(vf);
  float *dqp = dq.data_ptr<float>(), *dkp = dk.data_ptr<float>(), *dvp = dv.data_ptr<float>();
  const int64_t rows = pr.G * T, row_tiles = (rows + ROW_TILE - 1) / ROW_TILE, blocks = (Sk + KEY_BLOCK - 1) / KEY_BLOCK;
  for_each_task(B * Hkv * row_tiles, [&](int64_t i) {
    const int64_t b = i / (Hkv * row_tiles), h = i / row_tiles % Hkv, r0 = i % row_tiles * ROW_TILE;
    dq_task(bw, b, h, r0, std::min(rows, r0 + ROW_TILE), dqp);
  });
  for_each_task(B * Hkv * blocks, [&](int64_t i) {
    const int64_t b = i / (Hkv * blocks), h = i / blocks % Hkv, j0 = i % blocks * KEY_BLOCK;
    if (j0 < pr.lens[b]) dkv_task(bw, b, h, j0, dkp, dvp);
  });
  return {dq.to(q.scalar_type()), dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("first_bad_page", &first_bad_page, "the first page id of a block table outside the pool, or -1");
  // The GIL is released while the kernel runs: a server's other Python threads go on.
  m.def("paged_attention", &paged_attention, "paged attention over a block table (CPU, fp32 / bf16)",
        pybind11::arg("q"), pybind11::arg("k_pool"), pybind11::arg("v_pool"), pybind11::arg("table"),
        pybind11::arg("lens"), pybind11::arg("scale"), pybind11::arg("causal"), pybind11::arg("start"),
        pybind11::arg("state_m"), pybind11::arg("state_l"), pybind11::arg("state_acc"), pybind11::arg("finalize"),
        pybind11::arg("key_offset") = pybind11::none(), pybind11::arg("query_pos") = pybind11::none(),
        pybind11::arg("row_end") = pybind11::none(), pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("attention_backward", &attention_backward,
        "the input gradients of attention over contiguous (B, Hkv, Sk, D) keys, in a fixed order (CPU, fp32 / bf16)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.attr("KEY_BLOCK") = KEY_BLOCK;
}
