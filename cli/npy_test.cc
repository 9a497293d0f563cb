#include "cli/npy.h"

#include <cstring>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvtier::npy {
namespace {

using ::testing::HasSubstr;

Array16 Sample() { return Array16{"<f2", {2, 3, 1, 4}, std::vector<uint16_t>(24, 0x3C00)}; }

TEST(Npy, SerializeThenParseRoundTrips) {
  Array16 a = Sample();
  a.data[5] = 0x1234;
  auto bytes = Serialize(a);
  EXPECT_EQ((bytes.size() - a.data.size() * 2) % 64, 0u);  // header padded like NumPy's
  auto back = Parse(bytes);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->descr, "<f2");
  EXPECT_EQ(back->shape, a.shape);
  EXPECT_EQ(back->data, a.data);
}

TEST(Npy, ParsesNumpyWrittenHeaders) {
  // What numpy.save writes for np.zeros((2, 2), np.uint16), byte for byte.
  std::string header = "{'descr': '<u2', 'fortran_order': False, 'shape': (2, 2), }";
  header.append(128 - 10 - header.size() - 1, ' ');
  header += '\n';
  std::vector<uint8_t> file = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0,
                               static_cast<uint8_t>(header.size()), 0};
  file.insert(file.end(), header.begin(), header.end());
  file.resize(file.size() + 8, 0);
  auto a = Parse(file);
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->descr, "<u2");
  EXPECT_EQ(a->shape, (std::vector<uint64_t>{2, 2}));
}

TEST(Npy, EveryTruncationIsInvalidArgument) {
  auto bytes = Serialize(Sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    auto r = Parse({bytes.data(), n});
    ASSERT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << n;
  }
}

TEST(Npy, RejectsHostileHeaders) {
  auto make = [](std::string header, size_t payload) {
    std::vector<uint8_t> f = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0,
                              static_cast<uint8_t>(header.size() & 0xFF),
                              static_cast<uint8_t>(header.size() >> 8)};
    f.insert(f.end(), header.begin(), header.end());
    f.resize(f.size() + payload, 0);
    return f;
  };
  struct Case {
    std::string header;
    size_t payload;
    const char* why;
  } cases[] = {
      {"{'descr': '<f4', 'fortran_order': False, 'shape': (2,), }", 8, "dtype"},
      {"{'descr': '>f2', 'fortran_order': False, 'shape': (2,), }", 4, "dtype"},
      {"{'descr': '<f2', 'fortran_order': True, 'shape': (2,), }", 4, "fortran_order"},
      {"{'descr': '<f2', 'fortran_order': False, 'shape': (3,), }", 4, "payload"},
      {"{'descr': '<f2', 'fortran_order': False, 'shape': (99999999999999,), }", 4, "too large"},
      {"{'descr': '<f2', 'fortran_order': False, 'shape': (4294967296, 4294967296, 16), }", 4,
       "too many elements"},
      {"{'descr': '<f2', 'fortran_order': False, 'shape': (a,), }", 4, "non-integer"},
      {"{'descr': '<f2', 'fortran_order': False, 'shape': (2, }", 4, "shape"},
      {"{'descr': '<f2', 'fortran_order': False, 'shape': (2", 4, "unterminated"},
      {"{'fortran_order': False, 'shape': (2,), }", 4, "descr"},
      {"{'descr': '<f2', 'shape': (2,), }", 4, "fortran_order"},
      {"{'descr': 7, 'fortran_order': False, 'shape': (2,), }", 4, "descr"},
      {"{'descr': '<f2', 'fortran_order': False, 'shape': (1,1,1,1,1,1,1,1,1), }", 2, "dimensions"},
  };
  for (const Case& c : cases) {
    auto r = Parse(make(c.header, c.payload));
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.header;
    EXPECT_THAT(r.status().message(), HasSubstr(c.why)) << c.header;
  }
  auto bytes = Serialize(Sample());
  bytes[0] = 'X';
  EXPECT_THAT(Parse(bytes).status().message(), HasSubstr("magic"));
  bytes = Serialize(Sample());
  bytes[6] = 9;
  EXPECT_THAT(Parse(bytes).status().message(), HasSubstr("version"));
  bytes = Serialize(Sample());
  bytes[8] = 0xFF;
  bytes[9] = 0xFF;
  EXPECT_EQ(Parse(bytes).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvtier::npy
