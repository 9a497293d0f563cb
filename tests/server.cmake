# kvtierd end to end: the daemon in-process (temp Unix socket, localhost:0)
# and the real binaries (CLI, SIGTERM + restart). The service logic and the
# client against a mock stub are unit tests: server/service_test.cc,
# client/kvtier_client_mock_test.cc.
# A test that spawns the real daemon (tests/daemon_process.h) gets its path
# as KVTIERD_PATH and builds after it.
function(kvtier_test_spawns_kvtierd name)
  target_compile_definitions(${name} PRIVATE KVTIERD_PATH="$<TARGET_FILE:kvtierd>")
  add_dependencies(${name} kvtierd)
endfunction()

kvtier_add_test(server_e2e_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/server_e2e_test.cc
  DEPS kvtier_server kvtier_client
  TIMEOUT 120)
# The gRPC listeners under abuse (no token, bodies that never come, readers
# that grant no flow-control window), with an nghttp2 client as the attacker.
kvtier_add_test(server_abuse_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/server_abuse_test.cc
  DEPS kvtier_server kvtier_client PkgConfig::NGHTTP2
  TIMEOUT 120)
# Out of file descriptors: the real kvtierd under a small RLIMIT_NOFILE,
# flooded with more TCP connections than it has descriptors, and the accept
# loops of the TCP listener and of the data plane when accept fails.
kvtier_add_test(server_fd_limits_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/server_fd_limits_test.cc
  DEPS kvtier_server kvtier_client
  TIMEOUT 60)
kvtier_test_spawns_kvtierd(server_fd_limits_test)
kvtier_add_test(server_cli_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/server_cli_test.cc
  DEPS kvtier_codec
  TIMEOUT 120)
target_compile_definitions(server_cli_test PRIVATE
  KVTIER_CLI_PATH="$<TARGET_FILE:kvtier>" KVTIERD_PATH="$<TARGET_FILE:kvtierd>")
add_dependencies(server_cli_test kvtier kvtierd)
# libkvtier across a restart of the real daemon (SIGKILL, SIGTERM).
kvtier_add_test(server_restart_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/server_restart_test.cc
  DEPS kvtier_client
  TIMEOUT 120)
kvtier_test_spawns_kvtierd(server_restart_test)
# kvtierd's memory once large inline gets end (the real daemon).
kvtier_add_test(server_memory_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/server_memory_test.cc
  DEPS kvtier_client
  TIMEOUT 120)
kvtier_test_spawns_kvtierd(server_memory_test)
# The GPU paged-cache path of libkvtier (client/kvtier_gpu.h) against an
# in-process daemon; skips without a CUDA device.
if(KVTIER_HAVE_CUDA)
  kvtier_add_test(server_gpu_test
    SOURCES ${CMAKE_CURRENT_LIST_DIR}/server_gpu_test.cc
    DEPS kvtier_server kvtier_client_gpu
    LABELS gpu
    TIMEOUT 120)
endif()
# kvtierd ready while its DRAM pool is populated behind it; SIGTERM then.
kvtier_add_test(server_startup_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/server_startup_test.cc
  DEPS GTest::gtest
  TIMEOUT 180)
kvtier_test_spawns_kvtierd(server_startup_test)
# The /metrics endpoint over loopback: answers, limits, slow and stalled
# clients, prompt shutdown.
kvtier_add_test(server_http_metrics_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/server_http_metrics_test.cc
  DEPS kvtier_http_metrics
  TIMEOUT 60)
# Lookup, plan and lookup-and-hold over the data plane, batched holds, gets
# and puts, prefetch within a byte budget, the held-bytes cap, the holds of
# a killed client, and the batch ops under hostile frames.
kvtier_add_test(server_ctl_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/server_ctl_test.cc
  DEPS kvtier_server kvtier_client
  TIMEOUT 120)
# Tenants (docs/tenancy.md): key namespaces on gRPC, the data plane and TCP,
# the shared namespace, quotas under a put storm, per-tenant metrics.
kvtier_add_test(server_tenancy_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/server_tenancy_test.cc
  DEPS kvtier_server kvtier_client
  TIMEOUT 120)
# The TCP listener with TLS and mutual TLS (certificates made by the test
# with the openssl CLI): handshakes that succeed and fail, the startup
# checks, and the verified client identity.
kvtier_add_test(server_tls_test
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/server_tls_test.cc
  DEPS kvtier_server kvtier_client OpenSSL::Crypto
  TIMEOUT 120)
target_compile_definitions(server_tls_test PRIVATE KVTIER_CLI_PATH="$<TARGET_FILE:kvtier>")
add_dependencies(server_tls_test kvtier)
