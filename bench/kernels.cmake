# Benchmarks of kernels/ (CUDA only). Each prints the baseline it is measured
# against, in the same run, and writes JSON (bench/results/*-kernels.json).
if(KVTIER_HAVE_CUDA)
  # CMake 3.25 does not know nvcc's C++20 flag (see kernels/CMakeLists.txt).
  if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
  endif()
  foreach(_kv_bench kernel_codec_bench kernel_attention_bench)
    kvtier_add_bench(${_kv_bench} SOURCES ${_kv_bench}.cu DEPS kvtier_kernels)
    target_compile_options(${_kv_bench} PRIVATE
      $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr>)
  endforeach()
endif()
