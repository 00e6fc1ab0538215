#pragma once
// Reading weights into a model: from a checkpoint's tensors (trainer/checkpoint.h's
// load_checkpoint and load_weights) or from another format's (a safetensors file, a transformers
// directory, an llm.c file), each rank reading only the boxes of its own slices. What the
// checkpoint code and the import code (trainer/weight_import.cpp) share.
#include <cstdint>
#include <string>
#include <vector>

#include "io/hdf5_file.h"
#include "model/stage_executor.h"
#include "trainer/adamw.h"

namespace trainer {

// This rank's elements of the tensors in `group` of a checkpoint ("optim/m/") into the
// optimizer's state `which`, piece by piece.
void load_state(const H5File& f, const std::string& group, const StageExecutor& model,
                AdamW& optimizer, AdamW::State which);
// A checkpoint's parameters into the model (and the optimizer's fp32 copy, if it keeps one).
void load_params(const H5File& f, StageExecutor& model, AdamW* optimizer);

// The rectangles (in the dataset's (rows, last dimension) view) that hold a parameter's local
// elements [begin, begin + count) (trainer/checkpoint.cpp).
void append_boxes(const ParamInfo& p, int64_t begin, int64_t count, std::vector<Box>& boxes);
// A checkpoint's format_version, checked to be one this build reads (trainer/checkpoint.cpp).
int64_t check_version(const H5File& f, const std::string& state_file);

}  // namespace trainer
