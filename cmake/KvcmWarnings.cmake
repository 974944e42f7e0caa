# Warnings for our own targets only (generated protobuf code is left alone).
add_library(kvcm_warnings INTERFACE)
target_compile_options(kvcm_warnings INTERFACE
  $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -Wshadow=local -Wnon-virtual-dtor>
  $<$<AND:$<COMPILE_LANGUAGE:CXX>,$<BOOL:${KVCM_WERROR}>>:-Werror>)
