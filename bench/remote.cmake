kvtier_add_bench(remote_bench
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/remote_bench.cc
  DEPS kvtier_cluster_peer OpenSSL::Crypto)
