// kaiten_cpu::packed_linear: oneDNN's linear on a weight reordered once at load
// (torch.ops.mkldnn._reorder_linear_weight), as a dispatcher op a compiled graph calls directly.
// Inductor lowers mkldnn::_linear_pointwise only for frozen (constant) weights, and an op defined
// in Python costs about 15 us a call in its layers of wrappers: a decode step makes 121 of them.
#include "aten_ops.h"

#include <ATen/core/dispatch/Dispatcher.h>

at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t out_features) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                          std::string("")};
  op.callBoxed(&stack);
  at::Tensor out = stack[0].toTensor();
  TORCH_CHECK(out.size(-1) == out_features, "packed_linear: ", out.size(-1), " output features, expected ",
              out_features);
  return out;
}

TORCH_LIBRARY_FRAGMENT(kaiten_cpu, m) {
  m.def("packed_linear(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

// The packed weight is an opaque oneDNN tensor, so calls dispatch on MkldnnCPU.
TORCH_LIBRARY_IMPL(kaiten_cpu, CPU, m) { m.impl("packed_linear", &packed_linear); }
TORCH_LIBRARY_IMPL(kaiten_cpu, MkldnnCPU, m) { m.impl("packed_linear", &packed_linear); }
