// The tenants file parser, the identity lookups (token, uid, TLS CN) and the
// per-tenant key namespaces (server/tenants.h).
#include "server/tenants.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/crypto.h"
#include "common/testing/temp_dir.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/grpc_auth.h"

namespace kvtier::server {
namespace {

using ::testing::HasSubstr;

std::string TokenSha(std::string_view token) {
  return HexOf(Sha256(AsBytes(token)));
}

constexpr char kTokenA[] = "token-of-team-a-0123456789abcdef0123456789";
constexpr char kTokenB[] = "token-of-team-b-0123456789abcdef0123456789";

std::string TwoTenants() {
  return absl::StrCat("[[tenant]]\nname = \"a\"\ntoken_sha256 = \"", TokenSha(kTokenA),
                      "\"\nuids = [1001, 1002]\ntls_cn = [\"a.example\"]\ndram_gib = 0.5\n"
                      "[[tenant]]\nname = \"b\"\ntoken_sha256 = \"",
                      TokenSha(kTokenB), "\"\nshared = \"read\"\nnvme_gib = 2\n");
}

absl::Status ParseError(const std::string& text) { return ParseTenants(text).status(); }

TEST(ParseTenants, ReadsEveryField) {
  auto specs = ParseTenants(TwoTenants());
  ASSERT_TRUE(specs.ok()) << specs.status();
  ASSERT_EQ(specs->size(), 2u);
  const TenantSpec& a = (*specs)[0];
  EXPECT_EQ(a.name, "a");
  EXPECT_TRUE(a.has_token);
  EXPECT_EQ(a.uids, (std::vector<uint32_t>{1001, 1002}));
  EXPECT_EQ(a.tls_cns, (std::vector<std::string>{"a.example"}));
  EXPECT_EQ(a.shared, SharedAccess::kNone);
  EXPECT_EQ(a.quota_bytes[static_cast<int>(tiering::TierKind::kDram)], uint64_t{1} << 29);
  EXPECT_EQ((*specs)[1].shared, SharedAccess::kRead);
  EXPECT_EQ((*specs)[1].quota_bytes[static_cast<int>(tiering::TierKind::kNvme)], uint64_t{2} << 30);
}

TEST(ParseTenants, MalformedFilesAreInvalidArgumentNamingTheProblem) {
  const std::string sha = TokenSha(kTokenA);
  struct Case {
    std::string text;
    const char* says;
  };
  const Case cases[] = {
      {"", "no [[tenant]]"},
      {"[[tenant]]\nname = \"a\"\ncolour = \"red\"\n", "unknown key 'colour'"},
      {"tenant_count = 1\n", "unknown key 'tenant_count'"},
      {"[[tenant]]\nname = \"a\"\n[[tenant]]\nname = \"a\"\n", "name 'a' used twice"},
      {absl::StrCat("[[tenant]]\nname = \"a\"\ntoken_sha256 = \"", sha,
                    "\"\n[[tenant]]\nname = \"b\"\n", "token_sha256 = \"", sha, "\"\n"),
       "same token"},
      {"[[tenant]]\nname = \"a\"\nuids = [7]\n[[tenant]]\nname = \"b\"\nuids = [7]\n",
       "uid 7 of 'b' belongs to two tenants"},
      {"[[tenant]]\nname = \"a\"\nuids = [-1]\n", "uids must be integers"},
      {"[[tenant]]\nname = \"a\"\nuids = [4294967295]\n", "uids must be integers"},
      {"[[tenant]]\nname = \"a\"\nuids = [\"root\"]\n", "uids must be integers"},
      {"[[tenant]]\nname = \"a\"\nuids = 5\n", "uids must be an array"},
      {"[[tenant]]\nname = \"a\"\ntls_cn = [\"x\"]\n[[tenant]]\nname = \"b\"\ntls_cn = [\"x\"]\n",
       "tls_cn 'x'"},
      {"[[tenant]]\nname = \"a\"\ntoken_sha256 = \"abc\"\n", "64 hex digits"},
      {absl::StrCat("[[tenant]]\nname = \"a\"\ntoken_sha256 = \"", std::string(63, 'a'), "g\"\n"),
       "64 hex digits"},
      {"[[tenant]]\nname = \"a\"\nshared = \"write\"\n", "shared must be"},
      {"[[tenant]]\nname = \"a\"\ndram_gib = -1\n", "dram_gib must be"},
      {"[[tenant]]\nname = \"a\"\nnvme_gib = \"lots\"\n", "nvme_gib must be"},
      {"[[tenant]]\nname = \"a b\"\n", "name must be"},
      {"[[tenant]]\nuids = [1]\n", "name must be"},
      {absl::StrCat("[[tenant]]\nname = \"", std::string(65, 'x'), "\"\n"), "name must be"},
      {"[[tenant]]\nname = \"a\"\ndram_gib = 1\n[tenant\n", "tenants:"},
      {"tenant = 3\n", "[[tenant]] tables"},
  };
  for (const Case& c : cases) {
    absl::Status st = ParseError(c.text);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.text;
    EXPECT_THAT(st.message(), HasSubstr(c.says)) << c.text;
  }
}

TEST(ParseTenants, HostileInputIsRefusedWithoutCrashing) {
  // Truncations of a valid file at every byte, and bytes overwritten in it:
  // each parses or is InvalidArgument, never anything else.
  const std::string good = TwoTenants();
  auto parses_or_invalid = [](const std::string& text) {
    auto r = ParseTenants(text);
    return r.ok() || r.status().code() == absl::StatusCode::kInvalidArgument;
  };
  for (size_t n = 0; n < good.size(); ++n) EXPECT_TRUE(parses_or_invalid(good.substr(0, n))) << n;
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(0x80 + i % 100);
    EXPECT_TRUE(parses_or_invalid(bad)) << i;
  }
  EXPECT_EQ(ParseError(std::string(4096, '[')).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseError(std::string("[[tenant]]\nname = \"a\0b\"\n", 25)).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(LoadTenantsFile, MissingAndOversizedFiles) {
  kvtier::testing::TempDir dir;
  EXPECT_EQ(LoadTenantsFile(dir.path() + "/none.toml").status().code(),
            absl::StatusCode::kNotFound);
  const std::string big = dir.path() + "/big.toml";
  {
    FILE* f = std::fopen(big.c_str(), "w");
    ASSERT_NE(f, nullptr);
    const std::string line = "# padding padding padding padding padding padding padding\n";
    for (int i = 0; i < (2 << 20) / static_cast<int>(line.size()); ++i) std::fputs(line.c_str(), f);
    std::fclose(f);
  }
  EXPECT_EQ(LoadTenantsFile(big).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(TenantRegistry, FindsTenantsByTokenUidAndTlsIdentity) {
  TenantRegistry r(ParseTenants(TwoTenants()).value());
  ASSERT_TRUE(r.configured());
  ASSERT_NE(r.ByToken(kTokenA), nullptr);
  EXPECT_EQ(r.ByToken(kTokenA)->name(), "a");
  EXPECT_EQ(r.ByToken(kTokenB)->name(), "b");
  EXPECT_EQ(r.ByBearer(absl::StrCat("Bearer ", kTokenB))->name(), "b");
  EXPECT_EQ(r.ByBearer(kTokenB), nullptr);  // no "Bearer " prefix
  EXPECT_EQ(r.ByToken(""), nullptr);
  EXPECT_EQ(r.ByToken(std::string(kTokenA) + "x"), nullptr);
  EXPECT_EQ(r.ByUid(1002)->name(), "a");
  EXPECT_EQ(r.ByUid(1003), nullptr);
  EXPECT_EQ(r.ByTlsIdentity("a.example")->name(), "a");
  EXPECT_EQ(r.ByTlsIdentity("b.example"), nullptr);
  EXPECT_EQ(r.only(), nullptr);
  // Engine ids 1..n; 0 stays for chunks of no known tenant.
  EXPECT_EQ(r.ByToken(kTokenA)->id(), 1);
  EXPECT_EQ(r.ByToken(kTokenB)->id(), 2);
  const auto q = r.EngineQuotas();
  ASSERT_EQ(q.size(), 3u);
  EXPECT_EQ(q[1][static_cast<int>(tiering::TierKind::kDram)], uint64_t{1} << 29);
}

TEST(TenantRegistry, TenantWithoutTokenIsNeverFoundByAToken) {
  // An all-zero digest (a tenant without a token) matches no token.
  TenantRegistry r(ParseTenants("[[tenant]]\nname = \"a\"\nuids = [5]\n").value());
  EXPECT_EQ(r.ByToken(""), nullptr);
  EXPECT_EQ(r.ByToken(std::string(32, '\0')), nullptr);
}

TEST(TenantRegistry, WithoutAFileOneTenantStoresKeysAsSent) {
  TenantRegistry r;
  EXPECT_FALSE(r.configured());
  ASSERT_NE(r.only(), nullptr);
  const Hash128 k = Hash128::Of("key", 3);
  EXPECT_EQ(r.only()->WriteKey(k), k);
  EXPECT_EQ(r.only()->id(), 0);
  EXPECT_TRUE(r.EngineQuotas().empty());
}

TEST(Tenant, NamespacesAreDisjointAndNodeIndependent) {
  TenantRegistry r1(ParseTenants(TwoTenants()).value());
  TenantRegistry r2(ParseTenants(TwoTenants()).value());  // another node, same file
  const Tenant* a = r1.ByToken(kTokenA);
  const Tenant* b = r1.ByToken(kTokenB);
  for (int i = 0; i < 100; ++i) {
    const Hash128 k = Hash128::Of(absl::StrCat("prefix-", i), 7);
    EXPECT_NE(a->WriteKey(k), k);
    EXPECT_NE(a->WriteKey(k), b->WriteKey(k));
    EXPECT_EQ(a->WriteKey(k), r2.ByToken(kTokenA)->WriteKey(k));
  }
}

TEST(ConstantTimeEquals, TimeDoesNotDependOnWhereTheSecretsDiffer) {
  // A comparison that stops at the first difference is hundreds of times
  // faster for a first-byte mismatch than for a match of 64 KiB; this one
  // reads every byte either way. Minimum over many runs, with a wide
  // margin, so that a loaded machine does not make it flaky.
  const std::string secret(64 << 10, 's');
  std::string early = secret, late = secret;
  early[0] = 'x';
  late[late.size() - 1] = 'x';
  auto fastest = [&](const std::string& given) {
    double best = 1e9;
    for (int i = 0; i < 200; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      const bool eq = ConstantTimeEquals(given, secret);
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      EXPECT_EQ(eq, &given == &secret);
      best = std::min(best, s);
    }
    return best;
  };
  const double t_equal = fastest(secret), t_early = fastest(early), t_late = fastest(late);
  EXPECT_GT(t_early, t_equal / 4) << t_early << " vs " << t_equal;
  EXPECT_GT(t_late, t_equal / 4) << t_late << " vs " << t_equal;
  EXPECT_FALSE(ConstantTimeEquals("", secret));
  EXPECT_FALSE(ConstantTimeEquals(secret + "x", secret));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

}  // namespace
}  // namespace kvtier::server
