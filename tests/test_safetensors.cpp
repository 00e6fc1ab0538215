// The safetensors reader and writer (io/safetensors.h): our files read back exactly, a file
// written by an independent Python writer (tests/safetensors_tool.py) is read as it says, and
// every kind of damaged header is one DataError naming the file and the tensor.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "io/errors.h"
#include "io/safetensors.h"
#include "kernels/half.h"
#include "test_util.h"

namespace trainer {
namespace {

class Safetensors : public test::TempDirTest {
 protected:
  // A file of `header` (JSON text, length-prefixed) and `data` bytes.
  std::string raw_file(const std::string& name, const std::string& header, size_t data,
                       uint64_t length_override = 0) {
    std::ofstream out(path(name), std::ios::binary);
    const uint64_t n = length_override ? length_override : header.size();
    out.write(reinterpret_cast<const char*>(&n), 8);
    out << header << std::string(data, '\0');
    return path(name);
  }
  static std::string error_of(const std::string& file) {
    try {
      SafetensorsFile f(file);
    } catch (const DataError& e) {
      return e.what();
    }
    return "no error";
  }
};

TEST_F(Safetensors, OurFilesReadBackAndBoxesAreSlices) {
  std::vector<float> m(3 * 5), v = {1.0f, -2.5f, 3.14159265f, 1e-3f, 65504.0f, -0.0f, 7.0f};
  for (size_t i = 0; i < m.size(); i++) m[i] = float(i) * 0.37f - 2.0f;
  {
    SafetensorsWriter w(path("a.safetensors"), {{"arch", "test"}});
    w.add("m", "F32", {3, 5});
    w.add("v16", "BF16", {7});
    w.add("h16", "F16", {7});
    w.write("m", m.data());
    w.write("v16", v.data());
    w.write("h16", v.data());
    EXPECT_FALSE(std::filesystem::exists(path("a.safetensors")));  // not before close()
    w.close();
  }
  // Recognised by name, or by content without one; other files are not.
  std::filesystem::copy_file(path("a.safetensors"), path("weights"));
  EXPECT_TRUE(SafetensorsFile::is_one(path("weights")));
  std::ofstream(path("other")) << "\x89HDF\r\n\x1a\n and more";
  EXPECT_FALSE(SafetensorsFile::is_one(path("other")));
  SafetensorsFile f(path("weights"));
  EXPECT_EQ(f.metadata().at("arch"), "test");
  EXPECT_EQ(f.at("m").shape, (std::vector<int64_t>{3, 5}));
  std::vector<float> got(15);
  f.read_part("m", {3, 5}, {{0, 0, 3, 5}}, got.data());
  EXPECT_EQ(got, m);  // fp32 exactly
  // Rows 1-2, columns 3-4: what one tensor-parallel rank reads.
  f.read_part("m", {3, 5}, {{1, 3, 2, 2}}, got.data());
  EXPECT_EQ(std::vector<float>(got.begin(), got.begin() + 4),
            (std::vector<float>{m[8], m[9], m[13], m[14]}));
  std::vector<float> b(7), h(7);
  f.read_part("v16", {7}, {{0, 0, 1, 7}}, b.data());
  f.read_part("h16", {7}, {{0, 0, 1, 7}}, h.data());
  for (size_t i = 0; i < v.size(); i++) {
    EXPECT_EQ(b[i], to_float(to_bf16(v[i]))) << i;
    EXPECT_EQ(h[i], to_float(to_f16(v[i]))) << i;
  }
  // A 1-D box is columns (as in HDF5): elements 2..4.
  f.read_part("v16", {7}, {{0, 2, 1, 3}}, b.data());
  EXPECT_EQ(b[0], to_float(to_bf16(v[2])));
  try {
    f.read_part("m", {5, 3}, {{0, 0, 5, 3}}, got.data());
    FAIL();
  } catch (const DataError& e) {
    EXPECT_EQ(std::string(e.what()),
              path("weights") + ": tensor m has shape [3, 5], the model expects [5, 3]");
  }
}

// An independent writer (Python: struct, json, numpy), without header padding, in four dtypes.
TEST_F(Safetensors, AnIndependentWritersFileIsReadAsItSays) {
  const auto r = test::run_command(
      "/usr/bin/python3 " + test::source_dir() + "/tests/safetensors_tool.py write " +
      path("py.safetensors") +
      " '{\"metadata\": {\"format\": \"pt\"}, \"tensors\": ["
      "[\"d\", \"F64\", [2, 2], [0.1, 0.2, 0.3, 0.4]], [\"f\", \"F32\", [3], [1.5, -2, 3]], "
      "[\"h\", \"F16\", [2], [0.1, 1000]], [\"b\", \"BF16\", [1, 3], [0.1, -7, 3.3]]]}'");
  ASSERT_EQ(r.code, 0) << r.output;
  SafetensorsFile f(path("py.safetensors"));
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.tensors().size(), 4u);
  std::vector<float> v(4);
  f.read_part("d", {2, 2}, {{0, 0, 2, 2}}, v.data());
  EXPECT_EQ(v, (std::vector<float>{0.1f, 0.2f, 0.3f, 0.4f}));
  f.read_part("f", {3}, {{0, 0, 1, 3}}, v.data());
  EXPECT_EQ(std::vector<float>(v.begin(), v.begin() + 3), (std::vector<float>{1.5f, -2, 3}));
  f.read_part("h", {2}, {{0, 0, 1, 2}}, v.data());
  EXPECT_EQ(v[0], to_float(to_f16(0.1f)));
  EXPECT_EQ(v[1], 1000.0f);
  f.read_part("b", {1, 3}, {{0, 0, 1, 3}}, v.data());
  EXPECT_EQ(v[0], to_float(to_bf16(0.1f)));
  EXPECT_EQ(v[1], -7.0f);
  EXPECT_EQ(v[2], to_float(to_bf16(3.3f)));
}

TEST_F(Safetensors, DamagedHeadersAreNamed) {
  const std::string ok = R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  EXPECT_EQ(error_of(raw_file("ok", ok, 8)), "no error");
  // An empty tensor where another starts is no overlap.
  EXPECT_EQ(error_of(raw_file("empty",
                              R"({"b": {"dtype": "F32", "shape": [2], "data_offsets": )"
                              R"([0, 8]}, "a": {"dtype": "F32", "shape": [0], )"
                              R"("data_offsets": [0, 0]}})",
                              8)),
            "no error");
  struct Case {
    std::string header;
    size_t data;
    std::string message;  // after "<file>: "
  };
  for (const Case& c : std::vector<Case>{
           {"{\"a\": ", 8, "the header is not JSON ("},
           {"[1, 2]", 8, "the header is JSON but not an object"},
           {R"({"a": {"dtype": "F31", "shape": [2], "data_offsets": [0, 8]}})", 8,
            "tensor a: unknown dtype \"F31\""},
           {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})", 8,
            "tensor a: data_offsets [0,16] past the end of the data (8 bytes)"},
           {R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8,
            "tensor a: data_offsets [0, 8] hold 8 bytes, shape [3] of F32 needs 12"},
           {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", 8,
            "tensor a: data_offsets [8, 0] end before they begin"},
           {R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8,
            "tensor a: shape [-2] is not a list of sizes"},
           {R"({"a": {"dtype": "F32", "shape": [2]}})", 8,
            "tensor a: expected {\"dtype\": string, \"shape\": [...], \"data_offsets\": [begin, "
            "end]}"},
           {R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},)"
            R"( "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}})",
            12, "tensors a and b overlap (bytes [0, 8) and [4, 12))"},
           {R"({"__metadata__": {"n": 1}})", 0, "tensor __metadata__: n is not a string"},
       }) {
    SCOPED_TRACE(c.header);
    const std::string file = raw_file("bad", c.header, c.data);
    const std::string e = error_of(file);
    EXPECT_TRUE(e.starts_with(file + ": " + c.message)) << e;
  }
  const std::string past = raw_file("past", ok, 8, 1000);
  EXPECT_EQ(error_of(past),
            past +
                ": header length 1000 (the first 8 bytes) is past the end of the file (77 "
                "bytes) or over the format's 100 MB: not a safetensors file");
  std::ofstream(path("short")) << "abc";
  EXPECT_EQ(error_of(path("short")),
            path("short") + ": 3 bytes, too short for a safetensors file (at least 8)");
}

}  // namespace
}  // namespace trainer
