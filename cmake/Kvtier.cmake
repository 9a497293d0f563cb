# Helpers shared by every component.

# kvtier_add_library(NAME SOURCES ... DEPS ...): a static library rooted at the
# repository top so that includes read "codec/format.h".
function(kvtier_add_library name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_library(${name} STATIC ${ARG_SOURCES})
  target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PUBLIC ${ARG_DEPS})
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${KVTIER_WARNINGS}>)
endfunction()

# kvtier_add_test(NAME SOURCES ... DEPS ... [LABELS ...] [TIMEOUT s] [LAUNCHER program]):
# the one place every test is registered. Tests labelled "gpu" must call
# GTEST_SKIP() when no device is present.
function(kvtier_add_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT;LAUNCHER" "SOURCES;DEPS;LABELS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gmock GTest::gtest_main)
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${KVTIER_WARNINGS}>)
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  # An empty LABELS value would swallow the next keyword, so pass it only
  # when there are labels.
  set(props TIMEOUT ${ARG_TIMEOUT})
  if(ARG_LABELS)
    list(APPEND props LABELS "${ARG_LABELS}")
  endif()
  # LAUNCHER goes before each test's command (and the discovery's).
  if(ARG_LAUNCHER)
    set_target_properties(${name} PROPERTIES CROSSCOMPILING_EMULATOR ${ARG_LAUNCHER})
  endif()
  gtest_discover_tests(${name}
    DISCOVERY_TIMEOUT 60
    PROPERTIES ${props})
endfunction()

# kvtier_add_bench(NAME SOURCES ... DEPS ...): benchmarks are programs, not tests.
function(kvtier_add_bench name)
  cmake_parse_arguments(ARG "" "" "SOURCES;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:${KVTIER_WARNINGS}>)
endfunction()
