# Warnings for our own targets only (generated protobuf code is left alone).
add_library(kvcm_warnings INTERFACE)
if(CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
  # Clang spells GCC's -Wshadow=local as -Wshadow-uncaptured-local.
  set(_kvcm_shadow -Wshadow-uncaptured-local)
else()
  set(_kvcm_shadow -Wshadow=local)
endif()
target_compile_options(kvcm_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra ${_kvcm_shadow} -Wnon-virtual-dtor>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${KVCM_WERROR}>>:-Werror>)
if(KVCM_THREAD_SAFETY)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "KVCM_THREAD_SAFETY needs clang (-Wthread-safety)")
  endif()
  target_compile_options(kvcm_warnings INTERFACE $<$<COMPILE_LANGUAGE:CXX>:-Wthread-safety>)
endif()
