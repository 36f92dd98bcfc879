// A run of decoder layers in one call: torch.classes.eaglebatch.LayerStack (runtime.cpu_layer's
// CpuLayerStack). Each layer runs the same kernels, in the same order and on the same arguments,
// as runtime.cpu_layer.CpuLayerPlan (rms_norm, the fused q/k/v product, rope, write_kv,
// paged_attention, the o product, the residual add, rms_norm, the fused gate/up product, silu,
// mul, the down product, the add): the same bits. What it saves is Python between the kernels:
// a layer plan's ~12 calls from Python, each through argument parsing and the dispatcher, with
// attribute lookups and tensor views around them, cost tens of microseconds a layer, which a
// decode step of the default model (30 layers) and every draft step pay.
//
// The kernels live in the other sources' anonymous namespaces; they are called here through
// the dispatcher, which from C++ costs well under a microsecond a call. Every step the cpu
// attention backend's kernel takes (float32 caches, one metadata object for all layers) comes
// here, prompt chunks included; the rest runs layer by layer in Python.

#include <torch/custom_class.h>
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

namespace {

using OptTensor = std::optional<at::Tensor>;

// One panel product (runtime.cpu_gemm): packed panels, bias, output widths (one per part; a
// plain product has one), int8 scales, and 4-bit panels (nibbles, d and m) or none.
struct Product {
  at::Tensor panels;
  OptTensor bias;
  std::vector<int64_t> parts;
  OptTensor scales;
  OptTensor nibbles, dm;
};

struct Layer {
  OptTensor input_norm;  // none: EAGLE-1's first draft layer
  double input_eps;
  OptTensor q_norm, k_norm;  // per-head q / k norms (Qwen3-style), or none
  double qk_eps;
  int64_t heads, kv_heads, head_dim, window;
  double scale;
  Product qkv, o_proj, gate_up, down_proj;
  at::Tensor post_norm;
  double post_eps;
  bool q4;  // all four products have 4-bit panels (CpuLayerPlan.q4)
};

const auto& panel_linear() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eaglebatch::panel_linear", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const OptTensor&, int64_t,
                            const OptTensor&)>();
  return op;
}

const auto& panel_linear_parts() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eaglebatch::panel_linear_parts", "")
          .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const OptTensor&,
                                         at::IntArrayRef, const OptTensor&)>();
  return op;
}

const auto& panel_linear_q4() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eaglebatch::panel_linear_q4", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            const OptTensor&, int64_t)>();
  return op;
}

const auto& panel_linear_parts_q4() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eaglebatch::panel_linear_parts_q4", "")
          .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const OptTensor&, at::IntArrayRef)>();
  return op;
}

const auto& rms_norm() {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("eaglebatch::rms_norm", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, double)>();
  return op;
}

const auto& rope() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eaglebatch::rope", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&, const at::Tensor&,
                                                    const at::Tensor&)>();
  return op;
}

const auto& write_kv() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eaglebatch::write_kv", "")
          .typed<void(at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op;
}

const auto& paged_attention() {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("eaglebatch::paged_attention", "")
          .typed<void(const at::Tensor&, const at::Tensor&, at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&, const at::Tensor&, double,
                      int64_t)>();
  return op;
}

// A product on its 4-bit panels (q4) or on its float32 / bfloat16 / int8 ones, as the plan
// chooses for the step.
at::Tensor linear(const at::Tensor& x, const Product& p, bool q4) {
  if (q4) return panel_linear_q4().call(x, *p.nibbles, *p.dm, p.bias, p.parts[0]);
  return panel_linear().call(x, p.panels, p.bias, p.parts[0], p.scales);
}

std::vector<at::Tensor> parts(const at::Tensor& x, const Product& p, bool q4) {
  if (q4) return panel_linear_parts_q4().call(x, *p.nibbles, *p.dm, p.bias, p.parts);
  return panel_linear_parts().call(x, p.panels, p.bias, p.parts, p.scales);
}

// What a step's attention reads besides the cache: the metadata's slots and the kernel's rows
// (runtime.attention.cpu_backend's KernelRows), the same for every layer of the step.
struct StepRows {
  const at::Tensor& slot_mapping;
  const at::Tensor& query_starts;
  const at::Tensor& query_lens;
  const at::Tensor& seq_lens;
  const at::Tensor& block_table;
};

// CpuLayerPlan._run with the cpu attention backend's kernel, step for step; 4-bit
// panels where the layer has them and the step has at most q4_rows rows (as the plan).
at::Tensor run_layer(const Layer& l, at::Tensor x, const at::Tensor& residual,
                     const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
                     at::Tensor& kv_cache, const StepRows& s, int64_t q4_rows) {
  const int64_t n = x.size(0);
  const bool q4 = l.q4 && n <= q4_rows;
  if (l.input_norm) x = rms_norm().call(x, *l.input_norm, l.input_eps);
  const std::vector<at::Tensor> qkv = parts(x, l.qkv, q4);
  at::Tensor q = qkv[0].view({n, l.heads, l.head_dim});
  at::Tensor k = qkv[1].view({n, l.kv_heads, l.head_dim});
  const at::Tensor v = qkv[2].view({n, l.kv_heads, l.head_dim});
  if (l.q_norm) {
    q = rms_norm().call(q.view({-1, l.head_dim}), *l.q_norm, l.qk_eps).view(q.sizes());
    k = rms_norm().call(k.view({-1, l.head_dim}), *l.k_norm, l.qk_eps).view(k.sizes());
  }
  std::tie(q, k) = rope().call(q, k, cos, sin, positions);
  write_kv().call(kv_cache, k.contiguous(), v.contiguous(), s.slot_mapping);
  const at::Tensor query = q.contiguous();
  at::Tensor out = at::empty_like(query);
  paged_attention().call(query, kv_cache, out, s.query_starts, s.query_lens, s.seq_lens,
                         s.block_table, l.scale, l.window);
  const at::Tensor h = residual + linear(out.view({n, -1}), l.o_proj, q4);
  std::vector<at::Tensor> gate_up = parts(rms_norm().call(h, l.post_norm, l.post_eps),
                                          l.gate_up, q4);
  return h + linear(at::silu_(gate_up[0]).mul_(gate_up[1]), l.down_proj, q4);
}

struct LayerStack : torch::CustomClassHolder {
  std::vector<Layer> layers;

  // One layer, in order. tensors: input norm, q norm, k norm (each or None), post norm, then per
  // product (qkv, o, gate/up, down) panels, bias, scales, 4-bit nibbles, 4-bit d and m (the
  // last two None for all four products, or set for all four); ints: heads, kv_heads,
  // head_dim, window, then each product's output widths as a count followed by the widths;
  // floats: input eps, qk eps, post eps, attention scale.
  void add_layer(c10::List<OptTensor> tensors, std::vector<int64_t> ints,
                 std::vector<double> floats) {
    TORCH_CHECK(tensors.size() == 24 && floats.size() == 4 && ints.size() >= 8,
                "LayerStack.add_layer: 24 tensors, 4 floats and the ints of a layer");
    auto tensor = [&](size_t i) -> OptTensor { return tensors.get(i); };
    Layer l;
    l.input_norm = tensor(0);
    l.q_norm = tensor(1);
    l.k_norm = tensor(2);
    TORCH_CHECK(tensor(3).has_value(), "LayerStack.add_layer: the post-attention norm");
    l.post_norm = *tensor(3);
    l.heads = ints[0];
    l.kv_heads = ints[1];
    l.head_dim = ints[2];
    l.window = ints[3];
    l.input_eps = floats[0];
    l.qk_eps = floats[1];
    l.post_eps = floats[2];
    l.scale = floats[3];
    size_t at = 4;
    Product* products[] = {&l.qkv, &l.o_proj, &l.gate_up, &l.down_proj};
    int q4_products = 0;
    for (size_t p = 0; p < 4; ++p) {
      const size_t first = 4 + 5 * p;
      TORCH_CHECK(at < ints.size() && tensor(first).has_value(),
                  "LayerStack.add_layer: a product's panels and widths");
      const int64_t count = ints[at++];
      TORCH_CHECK(count >= 1 && at + count <= static_cast<int64_t>(ints.size()),
                  "LayerStack.add_layer: widths");
      std::vector<int64_t> widths(ints.begin() + at, ints.begin() + at + count);
      at += count;
      *products[p] = Product{*tensor(first), tensor(first + 1), std::move(widths),
                             tensor(first + 2), tensor(first + 3), tensor(first + 4)};
      const bool has_q4 = products[p]->nibbles.has_value() && products[p]->dm.has_value();
      q4_products += has_q4;
    }
    TORCH_CHECK(q4_products == 0 || q4_products == 4,
                "LayerStack.add_layer: 4-bit panels for all four products or none");
    l.q4 = q4_products == 4;
    TORCH_CHECK(l.qkv.parts.size() == 3 && l.gate_up.parts.size() == 2 &&
                l.o_proj.parts.size() == 1 && l.down_proj.parts.size() == 1,
                "LayerStack.add_layer: q/k/v in three parts, gate/up in two");
    layers.push_back(std::move(l));
  }

  // The layers over one step: layer 0 reads (x, residual), each later layer the residual stream
  // the one before it left (x = residual, as a decoder stack and a drafter run them). Returns
  // the last residual stream, then the streams entering the layers in aux_ids (EAGLE-3's
  // features), in that order.
  std::vector<at::Tensor> forward(at::Tensor x, at::Tensor residual, at::Tensor positions,
                                  at::Tensor cos, at::Tensor sin, std::vector<at::Tensor> caches,
                                  at::Tensor slot_mapping, at::Tensor query_starts, at::Tensor query_lens,
                                  at::Tensor seq_lens, at::Tensor block_table,
                                  std::vector<int64_t> aux_ids, int64_t q4_rows) {
    TORCH_CHECK(caches.size() == layers.size(), "LayerStack.forward: one cache per layer");
    for (const int64_t id : aux_ids)
      TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(layers.size()),
                  "LayerStack.forward: aux layer ", id, " outside the stack");
    const StepRows s{slot_mapping, query_starts, query_lens, seq_lens, block_table};
    std::vector<at::Tensor> out(1 + aux_ids.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      for (size_t a = 0; a < aux_ids.size(); ++a)
        if (aux_ids[a] == static_cast<int64_t>(i)) out[1 + a] = residual;
      residual = run_layer(layers[i], x, residual, positions, cos, sin, caches[i], s, q4_rows);
      x = residual;
    }
    out[0] = residual;
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(eaglebatch, m) {
  m.class_<LayerStack>("LayerStack")
      .def(torch::init<>())
      .def("add_layer", &LayerStack::add_layer)
      .def("forward", &LayerStack::forward);
}
