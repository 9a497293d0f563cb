# The architecture limits (scripts/check-architecture): file and function
# lengths of production sources and the include layers. No build needed.
add_test(NAME architecture_check
  COMMAND ${PROJECT_SOURCE_DIR}/scripts/check-architecture ${PROJECT_SOURCE_DIR})
add_test(NAME architecture_check_self_test
  COMMAND ${PROJECT_SOURCE_DIR}/scripts/check-architecture --self-test)
set_tests_properties(architecture_check architecture_check_self_test PROPERTIES TIMEOUT 60)
