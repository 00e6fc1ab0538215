// Warm starts ([init] from): a fresh run takes only the weights of a checkpoint written in
// another layout (and precision), and its optimizer state, step, schedule and data order start
// fresh; a checkpoint of another shape is a clear error. Real mpirun runs and real files.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <tuple>
#include <vector>

#include "io/hdf5_file.h"
#include "mpi_cli.h"
#include "test_util.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

// The validation losses of a run, by step.
std::vector<std::pair<int64_t, double>> val_losses(const std::string& out) {
  std::vector<std::pair<int64_t, double>> v;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) v.emplace_back(j["step"], j["val_loss"]);
  }
  return v;
}

TEST_F(MpiCli, WarmStartTakesTheWeightsOnlyFromAnotherLayout) {
  const std::string optim = "--set optim.lr=1e-2 --set optim.warmup_steps=4 ";
  // The source: 4 steps in tensor parallel, validated at its start and its end.
  const std::string source = path("source");
  auto r = mpirun(2, optim + "--set parallel.tp=2 --set train.steps=4 --set train.val_every=4 " +
                         "--set run.out_dir=" + quoted(source));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto source_val = val_losses(source);
  ASSERT_EQ(source_val.size(), 2u);
  ASSERT_EQ(source_val.back().first, 4);
  const std::string weights = source + "/checkpoints/step_00000004/state.h5";

  // One process, fp32: at step 0 it validates exactly the source's final weights.
  const std::string one = path("one");
  r = mpirun(1, optim + "--set train.steps=1 --set train.val_every=10 --set init.from=" +
                    quoted(source) + " --set run.out_dir=" + quoted(one));
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "initialized from " + weights +
                                " (weights of step 4; optimizer state, step, schedule and data "
                                "order start fresh)"),
            1)
      << r.output;
  const auto one_val = val_losses(one);
  ASSERT_FALSE(one_val.empty());
  EXPECT_EQ(one_val.front().first, 0);
  // fp32 sums in another order (tensor-parallel halves): a few units in the 7th digit.
  EXPECT_NEAR(one_val.front().second, source_val.back().second, 1e-5 * source_val.back().second);
  EXPECT_GT(std::abs(one_val.front().second - source_val.front().second), 1e-3);  // not its init
  // A fresh optimizer and schedule: Adam's first step moves every bias by lr(0) = lr / 4 exactly
  // (m / sqrt(v) = sign(g)); the source's moments or its step-4 learning rate would not.
  const std::vector<float> before = checkpoint_param(weights, "h.1.mlp.fc.bias"),
                           after = checkpoint_param(one + "/checkpoints/step_00000001/state.h5",
                                                    "h.1.mlp.fc.bias");
  ASSERT_EQ(before.size(), after.size());
  for (size_t i = 0; i < before.size(); i++)
    EXPECT_NEAR(std::abs(after[i] - before[i]), 1e-2 / 4, 1e-5) << i;

  // Two pipeline stages in bf16: the same weights, rounded to bf16 (about 3 significant digits).
  const std::string bf16 = path("bf16");
  r = mpirun(2, optim + "--set parallel.pp=2 --set train.steps=1 --set train.val_every=10 " +
                    "--set precision.compute=" + quoted("bf16") +
                    " --set init.from=" + quoted(weights) + " --set run.out_dir=" + quoted(bf16));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto bf16_val = val_losses(bf16);
  ASSERT_FALSE(bf16_val.empty());
  EXPECT_NEAR(bf16_val.front().second, source_val.back().second, 2e-2 * source_val.back().second);
}

// A checkpoint that does not fit the model: exit 2 before anything is written, naming the
// tensor and both shapes (or the tensor missing or left over).
TEST_F(MpiCli, WarmStartFromAnotherShapeIsAnError) {
  const std::string source = path("source");
  auto r = mpirun(1, "--set train.steps=1 --set run.out_dir=" + quoted(source));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string weights = source + "/checkpoints/step_00000001/state.h5";
  struct Case {
    std::string settings, message;
  };
  for (const Case& c : std::vector<Case>{
           {"--set model.d_model=32",
            weights + ": params/wte.weight has shape [256, 16], this model's is [256, 32]"},
           {"--set model.n_layer=3",
            weights + ": no tensor params/h.2.ln1.weight, which this model needs ([16]; the "
                      "checkpoint's model has n_layer = 2)"},
           {"--set model.n_layer=1",
            weights + ": params/h.1.ln1.weight has no place in this model (n_layer = 2 there, 1 "
                      "here)"},
           {"--set model.n_head=4",
            weights + ": checkpoint is for a model with n_head = 2, this model has n_head = 4"},
       }) {
    SCOPED_TRACE(c.settings);
    r = mpirun(2, c.settings + " --set init.from=" + quoted(source));
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_EQ(count(r.output, c.message), 1) << r.output;
    EXPECT_FALSE(std::filesystem::exists(path("out"))) << "nothing is written";
  }
}

// trainer export writes a checkpoint's weights as safetensors; an independent Python reader
// (tests/safetensors_tool.py) finds every tensor of the checkpoint in it, exactly in fp32 and
// rounded to nearest even in bf16 and fp16; [init] from reads it back. From a dp2 x tp2
// checkpoint into dp2 x tp2 the warm start is bit for bit the one from the checkpoint itself.
TEST_F(MpiCli, SafetensorsExportRoundTripsInAFourRankLayout) {
  const std::string layout = "--set parallel.dp=2 --set parallel.tp=2 ";
  const std::string source = path("source");
  auto r = mpirun(4, layout + "--set train.steps=3 --set run.out_dir=" + quoted(source));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string state = source + "/checkpoints/step_00000003/state.h5";
  const std::string tool = "/usr/bin/python3 " + test::source_dir() + "/tests/safetensors_tool.py ";
  for (const std::string dtype : {"fp32", "bf16", "fp16"}) {
    const std::string file = path(dtype + ".safetensors");
    r = test::run_command(test::trainer_bin() + " export --checkpoint " + source + " --out " +
                          file + " --dtype " + dtype);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.output.find("exported 28 tensors ("), 0u) << r.output;
    r = test::run_command(tool + "check " + file + " " + state);
    EXPECT_EQ(r.code, 0) << dtype << ": " << r.output;
    EXPECT_EQ(r.output, "ok 28 tensors, gpt2\n");
  }
  // Warm starts in the source's layout, from the checkpoint and from its export: the same run.
  const std::string warm = layout + "--set train.steps=2 --set train.val_every=1 ";
  for (const std::string& from : {state, path("fp32.safetensors"), path("bf16.safetensors")}) {
    r = mpirun(4, warm + "--set init.from=" + quoted(from) + " --set run.out_dir=" +
                      quoted(path("from_" + fs::path(from).stem().string())));
    ASSERT_EQ(r.code, 0) << r.output;
  }
  EXPECT_NE(r.output.find("initialized from " + path("bf16.safetensors") +
                          " (safetensors weights; optimizer state"),
            std::string::npos)
      << r.output;
  const auto from_h5 = val_losses(path("from_state")), from_st = val_losses(path("from_fp32")),
             from_bf16 = val_losses(path("from_bf16"));
  ASSERT_EQ(from_h5.size(), 3u);
  EXPECT_EQ(from_st, from_h5);  // bit for bit
  expect_same_tensors(path("from_state/checkpoints/step_00000002/state.h5"),
                      path("from_fp32/checkpoints/step_00000002/state.h5"), cli_model());
  // The bf16 export holds about 3 significant digits of each weight.
  EXPECT_NEAR(from_bf16.front().second, from_h5.front().second, 1e-2 * from_h5.front().second);
  EXPECT_NE(from_bf16.front().second, from_h5.front().second);
}

// Both architectures, dp2 x tp2: a warm start from the safetensors export and from the
// transformers directory is bit for bit the warm start from the checkpoint (losses, weights,
// moments): the export and the import are exact inverses, however the layout slices them.
TEST_F(MpiCli, ExportsRoundTripForGpt2AndLlamaInAFourRankLayout) {
  ModelConfig llama = cli_model();
  llama.arch = Arch::llama;
  llama.n_head = 4, llama.n_kv_head = 2, llama.d_model = 32, llama.ffn_hidden = 64;
  llama.tie_embeddings = false;
  const std::string llama_settings = "--set model.arch=" + quoted("llama") +
                                     " --set model.n_head=4 --set model.n_kv_head=2 "
                                     "--set model.d_model=32 --set model.ffn_hidden=64 ";
  const std::string layout = "--set parallel.dp=2 --set parallel.tp=2 ";
  for (const auto& [arch, settings, model] :
       {std::tuple{std::string("gpt2"), std::string(), cli_model()},
        std::tuple{std::string("llama"), llama_settings, llama}}) {
    SCOPED_TRACE(arch);
    const std::string source = path(arch);
    auto r =
        mpirun(4, layout + settings + "--set train.steps=3 --set run.out_dir=" + quoted(source));
    ASSERT_EQ(r.code, 0) << r.output;
    for (const std::string format : {"safetensors", "hf"}) {
      r = test::run_command(test::trainer_bin() + " export --format " + format + " --checkpoint " +
                            source + " --out " + path(arch + "." + format));
      ASSERT_EQ(r.code, 0) << r.output;
    }
    const std::string warm = layout + settings + "--set train.steps=2 --set train.val_every=1 ";
    const std::string state = source + "/checkpoints/step_00000003/state.h5";
    for (const std::string& from : {state, path(arch + ".safetensors"), path(arch + ".hf")}) {
      r = mpirun(4, warm + "--set init.from=" + quoted(from) +
                        " --set run.out_dir=" + quoted(from + ".warm"));
      ASSERT_EQ(r.code, 0) << r.output;
    }
    EXPECT_NE(r.output.find("(weights in transformers' layout;"), std::string::npos) << r.output;
    const auto base = val_losses(state + ".warm");
    ASSERT_EQ(base.size(), 3u);
    for (const std::string& from : {path(arch + ".safetensors"), path(arch + ".hf")}) {
      SCOPED_TRACE(from);
      EXPECT_EQ(val_losses(from + ".warm"), base);
      expect_same_tensors(state + ".warm/checkpoints/step_00000002/state.h5",
                          from + ".warm/checkpoints/step_00000002/state.h5", model);
    }
  }
}

// A GPT-2 directory as the hub holds one, written by an independent Python writer (no
// "transformer." prefix, causal-mask buffers among the weights): imported in tp2 and trained one
// step at lr 0, its re-export holds the same weights bit for bit. Directories that do not fit:
// one line naming every disagreeing config.json field, or the tensor, exit 2, nothing written.
TEST_F(MpiCli, HfDirectoriesImportAndThoseThatDoNotFitAreNamed) {
  auto python = [&](const std::string& code) {
    std::ofstream(path("script.py")) << "import json, os, shutil, sys\nsys.path.insert(0, \""
                                     << test::source_dir() << "/tests\")\nimport hf_reference\n"
                                     << code;
    return test::run_command("/usr/bin/python3 " + path("script.py"));
  };
  const std::string hub = path("hub");
  auto r = python("hf_reference.write_random_gpt2(\"" + hub + "\", 2, 2, 16, 16, 256, 7)\n");
  ASSERT_EQ(r.code, 0) << r.output;
  r = mpirun(2, "--set parallel.tp=2 --set train.steps=1 --set optim.lr=0 --set init.from=" +
                    quoted(hub) + " --set run.out_dir=" + quoted(path("imported")));
  ASSERT_EQ(r.code, 0) << r.output;
  r = test::run_command(test::trainer_bin() + " export --format hf --checkpoint " +
                        path("imported") + " --out " + path("again"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = python("print(hf_reference.same_weights(\"" + hub + "\", \"" + path("again") + "\"))\n");
  EXPECT_EQ(r.output, "28\n");
  // Greedy generation from the imported model: the same 24 bytes as the independent model in
  // transformers' conventions (past 16 tokens the window slides).
  r = python("sys.stdout.buffer.write(hf_reference.greedy_bytes(\"" + hub +
             "\", b\"It i\", 24))\n");
  ASSERT_EQ(r.code, 0) << r.output;
  ASSERT_EQ(r.output.size(), 24u);
  const std::string expected = "It i" + r.output + "\n";
  r = test::run_command(test::trainer_bin() + " generate --checkpoint " + path("imported") +
                        " --prompt 'It i' --tokens 24 --top-k 1");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output, expected);
  // Fine-tuning from it: 50 steps on the text bring the loss down from the imported model's.
  r = mpirun(1, "--set train.steps=50 --set optim.lr=3e-3 --set init.from=" + quoted(hub) +
                    " --set run.out_dir=" + quoted(path("tuned")));
  ASSERT_EQ(r.code, 0) << r.output;
  const auto tuned = steps_of(path("tuned/metrics.jsonl"));
  ASSERT_EQ(tuned.size(), 50u);
  EXPECT_LT(tuned.back().loss, 0.8 * tuned.front().loss);

  const std::string tool = "/usr/bin/python3 " + test::source_dir() + "/tests/safetensors_tool.py ";
  for (const std::string dir : {"dropped", "extra", "llama", "typed"}) {
    fs::create_directories(path(dir));
    fs::copy_file(hub + "/config.json", path(dir + "/config.json"));
  }
  ASSERT_EQ(test::run_command(tool + "drop " + hub + "/model.safetensors " +
                              path("dropped/model.safetensors") + " h.1.mlp.c_fc.bias")
                .code,
            0);
  ASSERT_EQ(test::run_command(tool + "extra " + hub + "/model.safetensors " +
                              path("extra/model.safetensors") + " lm_head.weight")
                .code,
            0);
  fs::copy_file(hub + "/model.safetensors", path("llama/model.safetensors"));
  fs::copy_file(hub + "/model.safetensors", path("typed/model.safetensors"));
  r = python("p = \"" + path("llama/config.json") +
             "\"\nc = json.load(open(p))\nc[\"architectures\"] = [\"LlamaForCausalLM\"]\n"
             "json.dump(c, open(p, \"w\"))\n");
  ASSERT_EQ(r.code, 0) << r.output;
  r = python("p = \"" + path("typed/config.json") +
             "\"\nc = json.load(open(p))\nc[\"activation_function\"] = None\n"
             "json.dump(c, open(p, \"w\"))\n");
  ASSERT_EQ(r.code, 0) << r.output;
  struct Case {
    std::string dir, settings, message;
  };
  for (const Case& c : std::vector<Case>{
           {hub, "--set model.d_model=32 --set model.n_layer=3 ",
            hub + "/config.json: n_embd = 16, [model] d_model = 32; n_layer = 2, [model] "
                  "n_layer = 3"},
           {path("llama"), "",
            path("llama") + "/config.json: architectures = [\"LlamaForCausalLM\"], [model] "
                            "arch = \"gpt2\" (GPT2LMHeadModel)"},
           {path("dropped"), "",
            path("dropped") + ": no tensor transformer.h.1.mlp.c_fc.bias ([64]), which this "
                              "model needs for h.1.mlp.fc.bias"},
           {path("extra"), "",
            path("extra") + ": tensor lm_head.weight has no place in this model (gpt2)"},
           {path("typed"), "", path("typed") + "/config.json: a field of an unexpected type ("},
           {hub, "--set model.bias=false ",
            hub + ": h.0.ln_1.bias is not zero, and this model has no biases (model.bias = "
                  "false)"},
       }) {
    SCOPED_TRACE(c.message);
    r = mpirun(2, c.settings + "--set init.from=" + quoted(c.dir));
    expect_refused(r, c.message);
    EXPECT_EQ(count(r.output, "\n"), 1) << r.output;
    EXPECT_FALSE(fs::exists(path("out"))) << "nothing is written";
  }
}

// llm.c's gpt2_124M.bin format, in fp32 (version 3) and bf16 (version 5): a file written by an
// independent Python writer following llm.c's train_gpt2.py, imported in tp2 and trained one
// step at lr 0, exports to the same bytes. Headers that do not fit: one line, exit 2.
TEST_F(MpiCli, LlmcCheckpointsImportAndExportTheSameBytes) {
  auto python = [&](const std::string& code) {
    std::ofstream(path("script.py")) << "import sys\nsys.path.insert(0, \"" << test::source_dir()
                                     << "/tests\")\nimport hf_reference\n"
                                     << code;
    return test::run_command("/usr/bin/python3 " + path("script.py"));
  };
  for (const auto& [version, dtype] : {std::pair{3, std::string("fp32")}, {5, "bf16"}}) {
    SCOPED_TRACE(dtype);
    const std::string bin = path(dtype + ".bin");
    auto r = python(fmt::format(
        "hf_reference.write_random_llmc(\"{}\", 2, 2, 16, 16, 256, 7, {})\n", bin, version));
    ASSERT_EQ(r.code, 0) << r.output;
    const std::string out = path(dtype + "_run");
    r = mpirun(2, "--set parallel.tp=2 --set train.steps=1 --set optim.lr=0 --set init.from=" +
                      quoted(bin) + " --set run.out_dir=" + quoted(out));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_NE(r.output.find("(weights in llm.c's format;"), std::string::npos) << r.output;
    r = test::run_command(test::trainer_bin() + " export --format llmc --dtype " + dtype +
                          " --checkpoint " + out + " --out " + path(dtype + "_again.bin"));
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(test::run_command("cmp " + bin + " " + path(dtype + "_again.bin")).code, 0);
  }
  const std::string bin = path("fp32.bin");
  {  // version 4, and the file cut short
    std::ifstream in(bin, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream(path("cut.bin"), std::ios::binary) << bytes.substr(0, bytes.size() - 4);
    bytes[4] = 4;
    std::ofstream(path("v4.bin"), std::ios::binary) << bytes;
    bytes[4] = 3;
    const int32_t layers = 1 << 24;  // a forged header: checked against the size first
    bytes.replace(16, 4, reinterpret_cast<const char*>(&layers), 4);
    std::ofstream(path("forged.bin"), std::ios::binary) << bytes.substr(0, 2048);
  }
  struct Case {
    std::string file, settings, message;
  };
  for (const Case& c : std::vector<Case>{
           {bin, "--set model.n_layer=3 --set model.d_model=32 ",
            bin + ": n_layer = 2, [model] n_layer = 3; d_model = 16, [model] d_model = 32"},
           {bin, "--set model.arch=" + quoted("llama") + " ",
            bin + ": llm.c's GPT-2 (tied embeddings, biases), [model] arch = llama, untied"},
           {path("v4.bin"), "", path("v4.bin") + ": version 4: llm.c writes 3 (fp32) or 5 (bf16)"},
           {path("forged.bin"), "", path("forged.bin") + ": 2048 bytes, the header's model needs "},
           {path("cut.bin"), "", path("cut.bin") + ": 44796 bytes, the header's model needs 44800"},
       }) {
    SCOPED_TRACE(c.message);
    const auto r = mpirun(2, c.settings + "--set init.from=" + quoted(c.file));
    expect_refused(r, c.message);
    EXPECT_EQ(count(r.output, "\n"), 1) << r.output;
  }
}

// trainer eval: on the run's validation set it prints the val loss the run logged at that step,
// exactly in the run's layout and within reduction-order tolerance in another; another data set
// and batch count; a checkpoint that is not there or does not fit the settings, exit 2.
TEST_F(MpiCli, EvalGivesTheLoggedValidationLossInAnyLayout) {
  auto r = mpirun(2, "--set parallel.dp=2 --set train.steps=4 --set train.val_every=4");
  ASSERT_EQ(r.code, 0) << r.output;
  const auto logged = val_losses(path("out"));
  ASSERT_EQ(logged.size(), 2u);
  ASSERT_EQ(logged.back().first, 4);
  auto eval = [&](int ranks, const std::string& args) {
    return test::run_command("timeout 60 " + test::mpiexec() +
                             " -q --allow-run-as-root --oversubscribe -np " +
                             std::to_string(ranks) + " " + test::trainer_bin() +
                             " eval --checkpoint " + path("out") + " " + args);
  };
  // The loss as printed: "eval: loss X, perplexity ...".
  auto loss_of = [](const std::string& output) {
    const size_t at = output.find("eval: loss ");
    return at == std::string::npos ? -1.0 : std::stod(output.substr(at + 11));
  };
  r = eval(2, "");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(count(r.output, "\n"), 1) << r.output;  // one line, rank 0's
  EXPECT_EQ(r.output.find(fmt::format("eval: loss {:.6f}, perplexity {:.3f} on 16 windows of 16 "
                                      "tokens of {} (weights of step 4 from ",
                                      logged.back().second, std::exp(logged.back().second),
                                      path("data/val.bin"))),
            0u)
      << r.output;
  r = eval(2, "--set parallel.dp=1 --set parallel.tp=2");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NEAR(loss_of(r.output), logged.back().second, 1e-5 * logged.back().second) << r.output;
  r = eval(1, "--data " + path("data/train.bin") + " --batches 3");
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("on 6 windows of 16 tokens of " + path("data/train.bin")),
            std::string::npos)
      << r.output;
  EXPECT_GT(loss_of(r.output), 0);
  EXPECT_NE(loss_of(r.output), logged.back().second);

  r = eval(2, "--set model.d_model=32");
  expect_refused(r, path("out/checkpoints/step_00000004/state.h5") +
                        ": params/wte.weight has shape [256, 16], this model's is [256, 32]");
  r = test::run_command(test::trainer_bin() + " eval --checkpoint " + path("nothing"));
  expect_refused(r, path("nothing") + ": no such checkpoint");
  r = test::run_command(test::trainer_bin() + " export --checkpoint " + path("out") + " --out " +
                        path("w.safetensors"));
  ASSERT_EQ(r.code, 0) << r.output;
  r = test::run_command(test::trainer_bin() + " eval --checkpoint " + path("w.safetensors"));
  expect_refused(r, path("w.safetensors") +
                        ": weights without a run (safetensors, a "
                        "transformers directory or llm.c's format): usable "
                        "as [init] from, not as a checkpoint of ours");
}

// trainer eval --choices: HellaSwag-style accuracy, the same in one process, dp2 and tp2 x pp2, and
// the same as the independent PyTorch model in transformers' conventions scores the exported
// weights (each ending after a space, by mean and by total loss).
TEST_F(MpiCli, EvalScoresMultipleChoiceAsTheIndependentModel) {
  auto r = mpirun(1, "--set train.steps=20 --set optim.lr=1e-2");
  ASSERT_EQ(r.code, 0) << r.output;
  // Eight examples from the text: a context, its true continuation and three other passages,
  // the endings 4, 7, 10 and 13 characters long (so that mean and total loss disagree).
  const std::string text =
      text_of(test::source_dir() + "/tests/data/pride_and_prejudice_opening.txt");
  {
    std::ofstream out(path("choices.jsonl"));
    for (int i = 0; i < 8; i++) {
      const size_t at = 200 + size_t(i) * 331;
      nlohmann::json endings = nlohmann::json::array();
      const int label = i % 4;
      for (int e = 0; e < 4; e++)
        endings.push_back(
            text.substr(e == label ? at + 40 : at + 2000 + 97 * e, size_t(4 + 3 * e)));
      out << nlohmann::json{{"ctx", text.substr(at, 40)}, {"endings", endings}, {"label", label}}
                 .dump()
          << "\n";
    }
  }
  r = test::run_command(test::trainer_bin() + " export --format hf --checkpoint " + path("out") +
                        " --out " + path("hf"));
  ASSERT_EQ(r.code, 0) << r.output;
  std::ofstream(path("score.py")) << "import sys\nsys.path.insert(0, \"" << test::source_dir()
                                  << "/tests\")\nimport hf_reference\n"
                                  << "print(\"acc_norm {:.4f} (lowest mean loss), acc {:.4f} "
                                     "(lowest total) on {} examples\".format("
                                  << "*hf_reference.score_choices(\"" << path("hf") << "\", \""
                                  << path("choices.jsonl") << "\")))\n";
  r = test::run_command("/usr/bin/python3 " + path("score.py"));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string expected = "eval: " + r.output.substr(0, r.output.size() - 1) + " of ";
  std::cout << "the independent model's scores: " << r.output;
  for (const auto& [ranks, layout] : {std::pair{1, std::string()},
                                      {2, "--set parallel.dp=2"},
                                      {4, "--set parallel.tp=2 --set parallel.pp=2"},
                                      // Endings of any length: one sequence runs whole.
                                      {2,
                                       "--set parallel.tp=2 --set "
                                       "parallel.sequence_parallel=true"},
                                      // Each sequence padded to 2 cp chunks, its losses gathered.
                                      {2, "--set parallel.cp=2"},
                                      {4,
                                       "--set parallel.cp=2 --set parallel.tp=2 --set "
                                       "parallel.sequence_parallel=true"}}) {
    SCOPED_TRACE(layout);
    r = test::run_command("timeout 60 " + test::mpiexec() +
                          " -q --allow-run-as-root --oversubscribe -np " + std::to_string(ranks) +
                          " " + test::trainer_bin() + " eval --checkpoint " + path("out") +
                          " --choices " + path("choices.jsonl") + " " + layout);
    ASSERT_EQ(r.code, 0) << r.output;
    EXPECT_EQ(r.output.find(expected), 0u) << r.output << "expected: " << expected;
  }
  std::ofstream(path("bad.jsonl")) << "{\"ctx\": \"a\", \"endings\": [\"b\"], \"label\": 0}\n";
  r = test::run_command(test::trainer_bin() + " eval --checkpoint " + path("out") + " --choices " +
                        path("bad.jsonl"));
  expect_refused(r, path("bad.jsonl") +
                        ":1: expected {\"ctx\": string, \"endings\": [2 or more "
                        "strings], \"label\": index}");
  std::ofstream(path("label.jsonl"))
      << "{\"ctx\": \"a\", \"endings\": [\"b\", \"c\"], \"label\": 4294967296}\n";
  r = test::run_command(test::trainer_bin() + " eval --checkpoint " + path("out") + " --choices " +
                        path("label.jsonl"));
  expect_refused(r, path("label.jsonl") + ":1: label 4294967296 of 2 endings");
}

// Weights that do not fit the model: exit 2, one line naming the tensor (and both shapes).
TEST_F(MpiCli, SafetensorsThatDoNotFitAreNamed) {
  auto r = mpirun(1, "--set train.steps=1 --set run.out_dir=" + quoted(path("source")));
  ASSERT_EQ(r.code, 0) << r.output;
  const std::string w = path("w.safetensors");
  ASSERT_EQ(test::run_command(test::trainer_bin() + " export --checkpoint " + path("source") +
                              " --out " + w)
                .code,
            0);
  const std::string tool = "/usr/bin/python3 " + test::source_dir() + "/tests/safetensors_tool.py ";
  ASSERT_EQ(
      test::run_command(tool + "drop " + w + " " + path("drop.safetensors") + " h.1.mlp.fc.bias")
          .code,
      0);
  ASSERT_EQ(test::run_command(tool + "extra " + w + " " + path("extra.safetensors") +
                              " h.9.attn.qkv.weight")
                .code,
            0);
  ASSERT_EQ(
      test::run_command(tool + "meta " + w + " " + path("meta.safetensors") + " n_head 4").code, 0);
  {
    std::ifstream in(w, std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), {});
    std::ofstream(path("cut.safetensors"), std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  }
  struct Case {
    std::string file, settings, message;
  };
  for (const Case& c : std::vector<Case>{
           {"drop.safetensors", "", ": no tensor h.1.mlp.fc.bias, which this model needs ([64])"},
           {"extra.safetensors", "",
            ": tensor h.9.attn.qkv.weight (F32 [2]) has no place in this model (gpt2)"},
           {"meta.safetensors", "",
            ": the weights are for a model with n_head = 4, this model has n_head = 2"},
           {"w.safetensors", "--set model.d_model=32 ",
            ": wte.weight has shape [256, 16], this model's is [256, 32]"},
           {"cut.safetensors", "", ": tensor "},
       }) {
    SCOPED_TRACE(c.file);
    r = mpirun(2, c.settings + "--set init.from=" + quoted(path(c.file)));
    expect_refused(r, path(c.file) + c.message);
    EXPECT_EQ(count(r.output, "\n"), 1) << r.output;
    EXPECT_FALSE(fs::exists(path("out"))) << "nothing is written";
  }
}

// trainer export --format hf: transformers' names, shapes and config.json, one model.safetensors,
// or above --max-shard-mb shards and an index that hold exactly the same tensors. (That these
// weights compute our logits is tests/hf_reference.py, for every architecture variant.)
TEST_F(MpiCli, HfExportIsTransformersLayoutShardedAboveTheLimit) {
  const std::string model = "--set model.d_model=128 --set model.n_head=4 ";
  auto r = mpirun(1, model + "--set train.steps=1 --set run.out_dir=" + quoted(path("source")));
  ASSERT_EQ(r.code, 0) << r.output;
  for (const std::string shard : {"5000", "1"}) {
    r = test::run_command(test::trainer_bin() + " export --format hf --checkpoint " +
                          path("source") + " --out " + path("hf" + shard) + " --max-shard-mb " +
                          shard);
    ASSERT_EQ(r.code, 0) << r.output;
  }
  EXPECT_NE(r.output.find(": 5 files in "), std::string::npos)
      << r.output;  // 2 shards, the index, the configs
  // Again into the same directory: refused, the export there untouched (no shards of two
  // exports in one directory).
  const auto before = fs::last_write_time(path("hf1/config.json"));
  r = test::run_command(test::trainer_bin() + " export --format hf --checkpoint " + path("source") +
                        " --out " + path("hf1"));
  EXPECT_EQ(r.code, 2) << r.output;
  EXPECT_NE(r.output.find(path("hf1") + ": exists and is not an empty directory"),
            std::string::npos)
      << r.output;
  EXPECT_EQ(fs::last_write_time(path("hf1/config.json")), before);
  const std::string check =
      "import json, os, sys\n"
      "sys.path.insert(0, \"" +
      test::source_dir() +
      "/tests\")\n"
      "import hf_reference\n"
      "one, sharded = (hf_reference.load_hf_dir(\"" +
      path("hf") +
      "\" + s) for s in (\"5000\", \"1\"))\n"
      "assert sorted(os.listdir(\"" +
      path("hf5000") +
      "\")) == [\"config.json\", "
      "\"generation_config.json\", \"model.safetensors\"]\n"
      "index = json.load(open(\"" +
      path("hf1") +
      "/model.safetensors.index.json\"))\n"
      "assert len(set(index[\"weight_map\"].values())) == 2, index\n"
      "assert index[\"metadata\"][\"total_size\"] == 4 * sum(t.numel() for t in one.values())\n"
      "assert one.keys() == sharded.keys() and all((one[k] == sharded[k]).all() for k in one)\n"
      "c = json.load(open(\"" +
      path("hf1") +
      "/config.json\"))\n"
      "assert c[\"architectures\"] == [\"GPT2LMHeadModel\"] and c[\"n_embd\"] == 128, c\n"
      "assert one[\"transformer.h.1.attn.c_attn.weight\"].shape == (128, 384)\n"
      "assert \"lm_head.weight\" not in one and c[\"tie_word_embeddings\"]\n"
      "print(\"ok\", len(one))\n";
  std::ofstream(path("check.py")) << check;
  r = test::run_command("/usr/bin/python3 " + path("check.py"));
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_EQ(r.output, "ok 28\n");
}

}  // namespace
}  // namespace trainer
