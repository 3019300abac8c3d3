// CPU kernels for the torch engine's decode step (fp32), built on first use by kernels/cpu_decode.py.
//
// At a few dozen rows a decode step of a small model is many tiny ops; these two fuse the ones that
// dominate (samplers/torch_engine.py's profile): the MoE block (routing, expert GEMMs, combine) and
// attention over the static KV cache (q/k RMS norm, RoPE, the cache write, softmax(qK^T)V).
// Semantics are those of samplers/torch_model.py's torch path; tests/test_cpu_decode.py checks them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <vector>

namespace {

void check_f32(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got ", t.dim());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// x / rms(x) * w over n values, then the rotate-half RoPE with cos/sin: into out.
inline void norm_rope(const float* x, const float* w, const float* cos, const float* sin, float eps, int64_t n,
                      float* out) {
  float ss = dot(x, x, n);
  float r = 1.f / std::sqrt(ss / n + eps);
  float y[512];
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * r * w[i];
  int64_t half = n / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = y[i] * cos[i] - y[i + half] * sin[i];
  for (int64_t i = half; i < n; ++i) out[i] = y[i] * cos[i] + y[i - half] * sin[i];
}

// softmax(q k^T) v for `group` query heads q [group, hd] (normed, rotated, scaled) over the first `len`
// cached rows of one kv head (kb, vb: [max_len, hd]); out [group, hd]. Each k and v row is read once for
// all the group's heads. HD > 0 is head_dim at compile time (the loops over it unroll); 0: hd_rt.
template <int HD>
void attend_group(const float* q, const float* kb, const float* vb, int64_t len, int64_t group, int64_t hd_rt,
                  float* sc, float* out) {
  const int64_t hd = HD > 0 ? HD : hd_rt;
  for (int64_t l = 0; l < len; ++l) {
    const float* k = kb + l * hd;
    for (int64_t i = 0; i < group; ++i) {
      const float* qi = q + i * hd;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t c = 0; c < hd; ++c) acc += qi[c] * k[c];
      sc[i * len + l] = acc;
    }
  }
  std::vector<float> inv(group);
  for (int64_t i = 0; i < group; ++i) {
    float* si = sc + i * len;
    float m = si[0], sum = 0.f;
    for (int64_t l = 1; l < len; ++l) m = std::max(m, si[l]);
#pragma omp simd reduction(+ : sum)
    for (int64_t l = 0; l < len; ++l) {
      si[l] = std::exp(si[l] - m);  // vectorised (libmvec) under -ffast-math
      sum += si[l];
    }
    inv[i] = 1.f / sum;
  }
  std::fill_n(out, group * hd, 0.f);
  for (int64_t l = 0; l < len; ++l) {
    const float* v = vb + l * hd;
    for (int64_t i = 0; i < group; ++i) {
      const float w = sc[i * len + l];
      float* oi = out + i * hd;
#pragma omp simd
      for (int64_t c = 0; c < hd; ++c) oi[c] += w * v[c];
    }
  }
  for (int64_t i = 0; i < group; ++i)
    for (int64_t c = 0; c < hd; ++c) out[i * hd + c] *= inv[i];
}

}  // namespace

// The MoE block of Qwen3-MoE on x [N, H]: router logits x @ router^T, softmax over experts, top-k
// (renormalised when `normalize`), then each (token, expert) pair through its expert's SwiGLU
// (w13 [E, H, 2I] = gate | up, w2 [E, I, H]) and the weighted sum per token.
// Pairs are counting-sorted by expert; experts run in parallel, largest first (dynamic schedule),
// each one GEMM per projection on its contiguous rows.
// `routes`: int64 [N, top_k] to receive each token's experts (routing replay), or empty for none.
at::Tensor moe_forward(const at::Tensor& x, const at::Tensor& router, const at::Tensor& w13,
                       const at::Tensor& w2, int64_t top_k, bool normalize, at::Tensor routes) {
  check_f32(x, "x", 2);
  check_f32(router, "router", 2);
  check_f32(w13, "w13", 3);
  check_f32(w2, "w2", 3);
  const int64_t n = x.size(0), h = x.size(1), e = w13.size(0), i2 = w13.size(2), inter = i2 / 2;
  TORCH_CHECK(router.size(0) == e && router.size(1) == h, "router must be [E, H]");
  TORCH_CHECK(w13.size(1) == h && i2 % 2 == 0, "w13 must be [E, H, 2I]");
  TORCH_CHECK(w2.size(0) == e && w2.size(1) == inter && w2.size(2) == h, "w2 must be [E, I, H]");
  TORCH_CHECK(top_k >= 1 && top_k <= e, "top_k must be in [1, E]");
  const int64_t pairs = n * top_k;
  auto out = at::empty({n, h}, x.options());
  if (n == 0) return out;

  // routing: top-k of the softmax over all experts (= of the logits), weights renormalised or not
  at::Tensor logits = at::mm(x.detach(), router.detach().t());
  const float* lg = logits.data_ptr<float>();
  std::vector<int64_t> expert(pairs);
  std::vector<float> weight(pairs);
  at::parallel_for(0, n, 16, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> idx(e);
    for (int64_t t = t0; t < t1; ++t) {
      const float* l = lg + t * e;
      std::iota(idx.begin(), idx.end(), 0);
      std::partial_sort(idx.begin(), idx.begin() + top_k, idx.end(),
                        [l](int64_t a, int64_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
      float m = l[idx[0]], all = 0.f, top = 0.f;
      for (int64_t j = 0; j < e; ++j) all += std::exp(l[j] - m);
      for (int64_t j = 0; j < top_k; ++j) top += std::exp(l[idx[j]] - m);
      float denom = normalize ? top : all;
      for (int64_t j = 0; j < top_k; ++j) {
        expert[t * top_k + j] = idx[j];
        weight[t * top_k + j] = std::exp(l[idx[j]] - m) / denom;
      }
    }
  });
  if (routes.numel() > 0) {
    TORCH_CHECK(routes.scalar_type() == at::kLong && routes.is_contiguous() && routes.numel() == pairs,
                "routes must be a contiguous int64 [N, top_k]");
    std::copy(expert.begin(), expert.end(), routes.data_ptr<int64_t>());
  }

  // counting sort of the pairs by expert (stable): pair p's rows live at row_of[p]
  std::vector<int64_t> start(e + 1, 0), row_of(pairs);
  for (int64_t p = 0; p < pairs; ++p) ++start[expert[p] + 1];
  for (int64_t j = 0; j < e; ++j) start[j + 1] += start[j];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < pairs; ++p) row_of[p] = fill[expert[p]]++;

  auto xs = at::empty({pairs, h}, x.options());
  auto hid = at::empty({pairs, i2}, x.options());
  auto act = at::empty({pairs, inter}, x.options());
  auto ys = at::empty({pairs, h}, x.options());
  const float* xp = x.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  at::parallel_for(0, pairs, 64, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) std::copy_n(xp + (p / top_k) * h, h, xsp + row_of[p] * h);
  });

  // work items: (expert, a run of at most `chunk` of its rows), dealt largest first to the least loaded
  // thread. Worker threads do not inherit the caller's inference mode: each sets its own, as these
  // are inference-only intermediates.
  const int64_t threads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(64, (pairs + 4 * threads - 1) / (4 * threads));
  std::vector<std::array<int64_t, 3>> items;  // expert, first row, rows
  for (int64_t j = 0; j < e; ++j)
    for (int64_t r = start[j]; r < start[j + 1]; r += chunk) items.push_back({j, r, std::min(chunk, start[j + 1] - r)});
  std::sort(items.begin(), items.end(), [](const auto& a, const auto& b) { return a[2] > b[2]; });
  std::vector<std::vector<std::array<int64_t, 3>>> plan(threads);
  std::vector<int64_t> load(threads, 0);
  for (const auto& item : items) {
    const auto least = std::min_element(load.begin(), load.end()) - load.begin();
    plan[least].push_back(item);
    load[least] += item[2];
  }
  float* hp = hid.data_ptr<float>();
  float* ap = act.data_ptr<float>();
  const at::Tensor w13d = w13.detach(), w2d = w2.detach();  // inference only: no autograd through mm_out
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    c10::InferenceMode guard;
    for (int64_t tid = t0; tid < t1; ++tid) {
      for (const auto& [j, r, rows] : plan[tid]) {
        at::Tensor hid_rows = hid.narrow(0, r, rows), ys_rows = ys.narrow(0, r, rows);
        at::mm_out(hid_rows, xs.narrow(0, r, rows), w13d[j]);
        for (int64_t q = r; q < r + rows; ++q) {
          const float* g = hp + q * i2;
          const float* u = g + inter;
          float* a = ap + q * inter;
#pragma omp simd
          for (int64_t c = 0; c < inter; ++c) a[c] = g[c] / (1.f + std::exp(-g[c])) * u[c];
        }
        at::mm_out(ys_rows, act.narrow(0, r, rows), w2d[j]);
      }
    }
  });

  // combine: each token's weighted sum over its k pairs
  const float* yp = ys.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* o = op + t * h;
      std::fill_n(o, h, 0.f);
      for (int64_t j = 0; j < top_k; ++j) {
        const float w = weight[t * top_k + j];
        const float* y = yp + row_of[t * top_k + j] * h;
#pragma omp simd
        for (int64_t c = 0; c < h; ++c) o[c] += w * y[c];
      }
    }
  });
  return out;
}

// One decode step's attention for slots 0..B-1, one layer. qkv [B, heads + 2 kv_heads, hd] (q | k | v
// heads, before norm and RoPE); qk_norm [heads + kv_heads, hd]; cos/sin [B, hd] at each slot's position;
// k_cache/v_cache [slots, kv_heads, max_len, hd] (one layer's view); positions [B] (int64). Writes the new
// k (normed, rotated) and v at positions[b] of slot b, then attends over 0..positions[b]. Returns
// [B, heads * hd]; q head i reads kv head i / (heads / kv_heads).
at::Tensor attend_decode(const at::Tensor& qkv, const at::Tensor& qk_norm, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor k_cache, at::Tensor v_cache,
                         const at::Tensor& positions, int64_t heads, double eps) {
  check_f32(qkv, "qkv", 3);
  check_f32(qk_norm, "qk_norm", 2);
  check_f32(cos, "cos", 2);
  check_f32(sin, "sin", 2);
  check_f32(k_cache, "k_cache", 4);
  check_f32(v_cache, "v_cache", 4);
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.dim() == 1, "positions must be int64 [B]");
  const int64_t b = qkv.size(0), hd = qkv.size(2), kv = k_cache.size(1), max_len = k_cache.size(2);
  TORCH_CHECK(hd <= 512 && hd % 2 == 0, "head_dim must be even and at most 512");
  TORCH_CHECK(qkv.size(1) == heads + 2 * kv && heads % kv == 0, "qkv must be [B, heads + 2 kv_heads, hd]");
  TORCH_CHECK(qk_norm.size(0) == heads + kv && qk_norm.size(1) == hd, "qk_norm must be [heads + kv_heads, hd]");
  TORCH_CHECK(cos.size(0) == b && cos.size(1) == hd && sin.sizes() == cos.sizes(), "cos/sin must be [B, hd]");
  TORCH_CHECK(k_cache.size(0) >= b && k_cache.size(3) == hd && v_cache.sizes() == k_cache.sizes(),
              "k_cache/v_cache must be [slots >= B, kv_heads, max_len, hd]");
  auto pos = positions.contiguous();
  const int64_t* pp = pos.data_ptr<int64_t>();
  for (int64_t s = 0; s < b; ++s)
    TORCH_CHECK(pp[s] >= 0 && pp[s] < max_len, "position ", pp[s], " outside the cache (", max_len, ")");
  auto out = at::empty({b, heads * hd}, qkv.options());
  const float* in = qkv.data_ptr<float>();
  const float* nw = qk_norm.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t group = heads / kv;
  const float scale = 1.f / std::sqrt(static_cast<float>(hd));
  at::parallel_for(0, b, 1, [&](int64_t s0, int64_t s1) {
    std::vector<float> q(group * hd), scores(group * max_len);
    for (int64_t s = s0; s < s1; ++s) {
      const float* row = in + s * (heads + 2 * kv) * hd;
      const int64_t p = pp[s], len = p + 1;
      for (int64_t g = 0; g < kv; ++g) {  // the new k and v of every kv head into the cache
        float* kslot = kc + ((s * kv + g) * max_len + p) * hd;
        norm_rope(row + (heads + g) * hd, nw + (heads + g) * hd, cp + s * hd, sp + s * hd, eps, hd, kslot);
        std::copy_n(row + (heads + kv + g) * hd, hd, vc + ((s * kv + g) * max_len + p) * hd);
      }
      for (int64_t g = 0; g < kv; ++g) {
        for (int64_t i = 0; i < group; ++i) {  // the kv group's query heads, normed, rotated and scaled
          const int64_t head = g * group + i;
          norm_rope(row + head * hd, nw + head * hd, cp + s * hd, sp + s * hd, eps, hd, q.data() + i * hd);
          for (int64_t c = 0; c < hd; ++c) q[i * hd + c] *= scale;
        }
        const float* kb = kc + (s * kv + g) * max_len * hd;
        const float* vb = vc + (s * kv + g) * max_len * hd;
        float* o = op + (s * heads + g * group) * hd;
        switch (hd) {  // head_dim known at compile time: the inner loops unroll
          case 32: attend_group<32>(q.data(), kb, vb, len, group, hd, scores.data(), o); break;
          case 64: attend_group<64>(q.data(), kb, vb, len, group, hd, scores.data(), o); break;
          case 128: attend_group<128>(q.data(), kb, vb, len, group, hd, scores.data(), o); break;
          default: attend_group<0>(q.data(), kb, vb, len, group, hd, scores.data(), o);
        }
      }
    }
  });
  return out;
}

// x / rms(x) * weight over the last dim of x [N, D] (fp32): one pass per row instead of the five ops
// of the composite F.rms_norm on CPU.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_f32(weight, "weight", 1);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be a float32 CPU tensor");
  const int64_t d = weight.size(0);
  TORCH_CHECK(x.size(-1) == d, "x's last dim must be weight's size");
  auto xc = x.contiguous();
  auto out = at::empty_like(xc);
  const int64_t n = xc.numel() / std::max<int64_t>(d, 1);
  const float* xp = xc.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * d;
      float* o = op + r * d;
      const float inv = 1.f / std::sqrt(dot(xr, xr, d) / d + static_cast<float>(eps));
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) o[c] = xr[c] * inv * w[c];
    }
  });
  return out;
}

// One decode step of a Qwen3 / Qwen3-MoE decoder for slots 0..B-1, all in C++ (no Python between the
// ops): tokens [B], positions [B] (int64); rope_cos/rope_sin [max_positions, hd]; k_cache/v_cache
// [layers, slots, kv_heads, max_len, hd]; per layer 8 tensors in `weights`: attn_norm [H], wqkv
// [(heads + 2 kv) * hd, H], qk_norm [heads + kv, hd], wo [H, heads * hd], ffn_norm [H], then the MoE
// router [E, H], w13 [E, H, 2I], w2 [E, I, H], or for a dense layer an empty router, w13 [2I, H] and
// w2 [H, I]; then embed [V, H], norm [H], lm_head [V, H]. Returns the logits [B, V].
at::Tensor decode_forward(const at::Tensor& tokens, const at::Tensor& positions, at::TensorList weights,
                          const at::Tensor& rope_cos, const at::Tensor& rope_sin, at::Tensor k_cache,
                          at::Tensor v_cache, int64_t heads, int64_t top_k, bool normalize, double eps,
                          at::Tensor routes) {
  TORCH_CHECK(weights.size() >= 3 && (weights.size() - 3) % 8 == 0, "weights: 8 per layer, then embed, norm, lm_head");
  const int64_t layers = static_cast<int64_t>(weights.size() - 3) / 8;
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.size(0) == layers, "k_cache must be [layers, slots, kv, max_len, hd]");
  TORCH_CHECK(tokens.dim() == 1 && positions.sizes() == tokens.sizes(), "tokens and positions must be [B]");
  const at::Tensor& embed = weights[8 * layers];
  at::Tensor x = at::embedding(embed.detach(), tokens);  // [B, H]
  const at::Tensor cos = rope_cos.index_select(0, positions), sin = rope_sin.index_select(0, positions);
  const int64_t b = tokens.size(0), hd = k_cache.size(4);
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + 8 * l;
    at::Tensor h = rms_norm(x, w[0].detach(), eps);
    at::Tensor qkv = at::mm(h, w[1].detach().t()).view({b, -1, hd});
    at::Tensor a = attend_decode(qkv, w[2].detach(), cos, sin, k_cache.select(0, l), v_cache.select(0, l),
                                 positions, heads, eps);
    x.addmm_(a, w[3].detach().t());
    h = rms_norm(x, w[4].detach(), eps);
    if (w[5].numel() > 0) {
      x.add_(moe_forward(h, w[5], w[6], w[7], top_k, normalize,
                         routes.numel() > 0 ? routes.select(0, l) : routes));
    } else {  // dense SwiGLU
      at::Tensor gu = at::mm(h, w[6].detach().t());
      const int64_t inter = gu.size(1) / 2;
      x.addmm_(at::silu(gu.narrow(1, 0, inter)).mul_(gu.narrow(1, inter, inter)), w[7].detach().t());
    }
  }
  return at::mm(rms_norm(x, weights[8 * layers + 1].detach(), eps), weights[8 * layers + 2].detach().t());
}

TORCH_LIBRARY(cascade_rl_cpu, m) {
  m.def("decode_forward(Tensor tokens, Tensor positions, Tensor[] weights, Tensor rope_cos, Tensor rope_sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, int heads, int top_k, bool normalize, float eps, "
        "Tensor(c!) routes) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("moe_forward(Tensor x, Tensor router, Tensor w13, Tensor w2, int top_k, bool normalize, Tensor(a!) routes) "
        "-> Tensor");
  m.def("attend_decode(Tensor qkv, Tensor qk_norm, Tensor cos, Tensor sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor positions, int heads, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(cascade_rl_cpu, CPU, m) {
  m.impl("decode_forward", decode_forward);
  m.impl("rms_norm", rms_norm);
  m.impl("moe_forward", moe_forward);
  m.impl("attend_decode", attend_decode);
}
