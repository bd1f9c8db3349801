// What every kernel source includes from torch: ATen's tensors and ops, and torch/library.h's
// TORCH_LIBRARY registration. Not torch/extension.h: it adds the C++ frontend, autograd and
// pybind11, and took each translation unit three times as long to compile
// (bench/results/kernel_build/README.md). The ops load with torch.ops.load_library, no Python module.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

// torch::Tensor, torch::empty, torch::kInt32... as torch/extension.h spells them: its
// torch/types.h exposes at:: in torch:: the same way and names the fixed-width dtypes.
namespace torch {
using namespace at;  // NOLINT(build/namespaces)
constexpr auto kInt8 = at::kChar;
constexpr auto kInt16 = at::kShort;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kFloat64 = at::kDouble;
}  // namespace torch
