# Tiering benchmarks: DRAM vs memcpy, NVMe vs raw io_uring, policy hit ratios.
kvtier_add_bench(tiering_bench
  SOURCES ${CMAKE_CURRENT_LIST_DIR}/tiering_bench.cc
  DEPS kvtier_tiering)
