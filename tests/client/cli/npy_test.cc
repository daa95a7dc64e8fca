#include "client/cli/npy.h"

#include <cstring>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace qtx::cli {
namespace {

using ::qtx::testing::StatusIs;
using ::testing::HasSubstr;

// A .npy file as numpy 1.24 writes np.arange(6, dtype='<f4').reshape(2, 3):
// magic, version 1.0, little-endian header length, dict padded to 64 bytes.
std::string NumpyFile(const std::string& dict, const std::string& payload, char major = 1) {
  std::string header = dict;
  const size_t prefix = major == 1 ? 10 : 12;
  header.append((64 - (prefix + header.size() + 1) % 64) % 64, ' ');
  header.push_back('\n');
  std::string out("\x93NUMPY", 6);
  out.push_back(major);
  out.push_back('\0');
  out.push_back(static_cast<char>(header.size() & 0xFF));
  out.push_back(static_cast<char>(header.size() >> 8));
  if (major != 1) out.append(2, '\0');
  return out + header + payload;
}

std::string Floats(std::vector<float> v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

TEST(NpyTest, ParsesNumpyHeader) {
  const std::string payload = Floats({0, 1, 2, 3, 4, 5});
  QTX_ASSERT_OK_AND_ASSIGN(
      NpyArray a,
      ParseNpy(NumpyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", payload)));
  EXPECT_EQ(a.dtype, DType::kFloat32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(a.data, payload);
}

TEST(NpyTest, ParsesVersion2AndOtherKeyOrders) {
  QTX_ASSERT_OK_AND_ASSIGN(
      NpyArray a, ParseNpy(NumpyFile("{'shape': (4,), 'fortran_order': False, 'descr': '<f2'}",
                                     std::string(8, '\0'), 2)));
  EXPECT_EQ(a.dtype, DType::kFloat16);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{4}));
  QTX_ASSERT_OK_AND_ASSIGN(
      NpyArray s, ParseNpy(NumpyFile("{'descr': '|u1', 'fortran_order': False, 'shape': (), }",
                                     std::string(1, '\x07'))));
  EXPECT_TRUE(s.shape.empty());
  EXPECT_EQ(s.data, "\x07");
}

TEST(NpyTest, RejectsWhatItCannotRead) {
  EXPECT_THAT(ParseNpy("not a numpy file"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("magic")));
  EXPECT_THAT(ParseNpy(NumpyFile("{'descr': '>f4', 'fortran_order': False, 'shape': (1,), }",
                                 std::string(4, '\0'))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("'>f4'")));
  EXPECT_THAT(ParseNpy(NumpyFile("{'descr': '<f8', 'fortran_order': False, 'shape': (1,), }",
                                 std::string(8, '\0'))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bfloat16")));
  EXPECT_THAT(ParseNpy(NumpyFile("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 2), }",
                                 std::string(16, '\0'))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("fortran_order")));
  EXPECT_THAT(ParseNpy(NumpyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
                                 std::string(20, '\0'))),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("file has 20")));
  EXPECT_THAT(
      ParseNpy(NumpyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }", "")),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bad dim")));
  std::string truncated =
      NumpyFile("{'descr': '<f4', 'fortran_order': False, 'shape': (1,), }", "");
  truncated.resize(20);
  EXPECT_THAT(ParseNpy(truncated),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("truncated")));
}

TEST(NpyTest, SerializeRoundTrips) {
  NpyArray a;
  a.dtype = DType::kFloat32;
  a.shape = {3};
  a.data = Floats({1.5f, -2.0f, 0.25f});
  const std::string file = SerializeNpy(a);
  EXPECT_EQ((file.size() - a.data.size()) % 64, 0u);
  EXPECT_NE(file.find("'shape': (3,)"), std::string::npos);
  QTX_ASSERT_OK_AND_ASSIGN(NpyArray b, ParseNpy(file));
  EXPECT_EQ(b.dtype, a.dtype);
  EXPECT_EQ(b.shape, a.shape);
  EXPECT_EQ(b.data, a.data);
}

TEST(NpyTest, MissingFileIsNotFound) {
  EXPECT_THAT(ReadNpyFile("/nonexistent/x.npy"),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("/nonexistent/x.npy")));
}

}  // namespace
}  // namespace qtx::cli
