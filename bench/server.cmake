kvtier_add_bench(server_bench
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/server_bench.cc
  DEPS kvtier_server kvtier_client)
