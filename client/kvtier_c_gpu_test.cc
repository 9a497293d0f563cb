// The GPU half of the C API rejects bad arguments with INVALID_ARGUMENT and a
// reason before it touches the device, so these run (and must pass) on
// machines without a GPU. Calls that move data are tested on the GPU from
// Python (python/tests/test_torch_gpu.py).
#include "client/kvtier_c_gpu.h"

#include <cstring>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace {

constexpr int kInvalidArgument = 3;

struct Desc {
  std::vector<uint64_t> k = {0x10000, 0x20000}, v = {0x10000, 0x20000};
  kvtier_gpu_cache_desc d;
  Desc() {
    kvtier_gpu_cache_desc_init(&d);
    d.num_layers = 2;
    d.num_blocks = 8;
    d.block_size = 16;
    d.num_kv_heads = 2;
    d.head_dim = 64;
    d.k_dtype = KVTIER_DTYPE_BF16;
    d.v_dtype = KVTIER_DTYPE_BF16;
    d.k_layers = k.data();
    d.v_layers = v.data();
    d.v_offset = 8 * 16 * 2 * 64;
    d.stride_block = 16 * 2 * 64;
    d.stride_token = 2 * 64;
    d.stride_head = 64;
  }
  int Create() {
    kvtier_gpu_cache* c = reinterpret_cast<kvtier_gpu_cache*>(1);
    int rc = kvtier_gpu_cache_create(&d, &c);
    if (rc == 0) kvtier_gpu_cache_destroy(c);
    EXPECT_TRUE(rc != 0 || c != nullptr);
    if (rc != 0) EXPECT_EQ(c, nullptr) << "no handle on failure";
    return rc;
  }
};

TEST(CApiGpu, DescInitSetsSizeAndCurrentDevice) {
  kvtier_gpu_cache_desc d;
  std::memset(&d, 0xAB, sizeof(d));
  kvtier_gpu_cache_desc_init(&d);
  EXPECT_EQ(d.struct_size, sizeof(d));
  EXPECT_EQ(d.device, -1);
  EXPECT_EQ(d.k_layers, nullptr);
  EXPECT_EQ(d.num_layers, 0u);
}

TEST(CApiGpu, BadCacheDescriptionsAreInvalidArgumentWithAReason) {
  EXPECT_EQ(kvtier_gpu_cache_create(nullptr, nullptr), kInvalidArgument);
  kvtier_gpu_cache* c = nullptr;
  EXPECT_EQ(kvtier_gpu_cache_create(nullptr, &c), kInvalidArgument);
  {
    Desc x;
    x.d.struct_size = 8;
    EXPECT_EQ(x.Create(), kInvalidArgument);
    EXPECT_NE(std::string(kvtier_last_error()).find("struct_size"), std::string::npos);
  }
  {
    Desc x;
    x.d.num_layers = 0;
    EXPECT_EQ(x.Create(), kInvalidArgument);
  }
  {
    Desc x;
    x.d.k_dtype = 9;
    EXPECT_EQ(x.Create(), kInvalidArgument);
    EXPECT_NE(std::string(kvtier_last_error()).find("k_dtype"), std::string::npos);
  }
  {
    Desc x;
    x.k[1] = 0x20008;  // not 16-byte aligned
    EXPECT_EQ(x.Create(), kInvalidArgument);
  }
  {
    Desc x;
    x.d.v_dtype = KVTIER_DTYPE_FP8E4M3;  // without v_scale_layers
    EXPECT_EQ(x.Create(), kInvalidArgument);
    EXPECT_NE(std::string(kvtier_last_error()).find("v_scale_layers"), std::string::npos);
  }
  {
    Desc x;
    x.d.stride_token = 2 * 64 + 4;  // strides are multiples of 8 elements
    EXPECT_EQ(x.Create(), kInvalidArgument);
  }
  {
    Desc x;
    x.d.k_layers = nullptr;
    EXPECT_EQ(x.Create(), kInvalidArgument);
  }
}

TEST(CApiGpu, NullHandlesAreInvalidArgument) {
  kvtier_gpu* g = nullptr;
  EXPECT_EQ(kvtier_gpu_open(nullptr, -1, &g), kInvalidArgument);
  uint8_t key[16] = {};
  int32_t ids[1] = {0};
  int tier = 0;
  EXPECT_EQ(kvtier_gpu_store(nullptr, key, key, "k16v8", nullptr, ids, 1, 0, 16, 0, 0),
            kInvalidArgument);
  int statuses[1] = {-1};
  EXPECT_EQ(kvtier_gpu_store_batch(nullptr, key, 1, key, "k16v8", nullptr, ids, 1, 0, 16, 0, 0,
                                   statuses),
            kInvalidArgument);
  EXPECT_EQ(statuses[0], -1);  // the call failed as a whole: no chunk's status
  EXPECT_EQ(kvtier_gpu_load(nullptr, key, nullptr, ids, 1, 0, 0, KVTIER_ALL_LAYERS, 0, &tier),
            kInvalidArgument);
  kvtier_gpu_layerwise* lw = nullptr;
  EXPECT_EQ(kvtier_gpu_load_layerwise(nullptr, key, 1, nullptr, ids, nullptr, nullptr, nullptr, 1,
                                      0, &lw),
            kInvalidArgument);
  EXPECT_EQ(kvtier_gpu_layerwise_wait_layer(nullptr, 0, 0), kInvalidArgument);
  EXPECT_EQ(kvtier_gpu_layerwise_finish(nullptr, nullptr, nullptr), kInvalidArgument);
  EXPECT_EQ(kvtier_attention_decode(nullptr, 0, KVTIER_DTYPE_BF16, 1, 8, 0, nullptr, 1, 0, nullptr,
                                    0, 0.0f, 0, 0),
            kInvalidArgument);
  kvtier_gpu_close(nullptr);
  kvtier_gpu_cache_destroy(nullptr);
  kvtier_gpu_layerwise_release(nullptr);
  kvtier_gpu_store_release(nullptr);
}

}  // namespace
