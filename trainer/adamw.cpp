#include "trainer/adamw.h"

namespace trainer {

AdamW::AdamW(GPT& model, const OptimConfig& cfg) : model_(model), cfg_(cfg) {
  m_ = model.kernels().alloc(model.table().total, model.dtype());
  v_ = model.kernels().alloc(model.table().total, model.dtype());
}

AdamW::~AdamW() {
  model_.kernels().free(m_);
  model_.kernels().free(v_);
}

float AdamW::weight_decay(const ParamInfo& p) const {
  switch (p.kind) {
    case ParamKind::matrix:
      return float(cfg_.weight_decay);
    case ParamKind::embedding:
      return cfg_.decay_embeddings ? float(cfg_.weight_decay) : 0.0f;
    case ParamKind::bias:
    case ParamKind::norm:
      return cfg_.decay_norms_and_biases ? float(cfg_.weight_decay) : 0.0f;
  }
  return 0.0f;
}

void AdamW::update(float lr, float grad_scale, int64_t step) {
  for (const ParamInfo& p : model_.table().params) {
    AdamWArgs args{lr,
                   float(cfg_.betas[0]),
                   float(cfg_.betas[1]),
                   float(cfg_.eps),
                   weight_decay(p),
                   step,
                   grad_scale};
    model_.kernels().adamw_update(model_.param(p), model_.grad(p), m_ + p.offset, v_ + p.offset,
                                  p.numel, args);
  }
}

}  // namespace trainer
