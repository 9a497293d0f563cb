kvtier_add_bench(codec_bench
  SOURCES ${CMAKE_CURRENT_SOURCE_DIR}/codec_bench.cc
  DEPS kvtier_codec)
