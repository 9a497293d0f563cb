kvtier_add_bench(server_bench
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/server_bench.cc
  DEPS kvtier_server kvtier_client)

kvtier_add_bench(copy_check_bench
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/copy_check_bench.cc
  DEPS kvtier_server)

kvtier_add_bench(tenant_keys_bench
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/tenant_keys_bench.cc
  DEPS kvtier_server)
