// What the two halves of libkvtier's C API share (kvtier_c.cc and, with
// CUDA, kvtier_c_gpu.cc): the client handle and the calling thread's last
// error. Not installed; no binding sees it.
#ifndef KVTIER_CLIENT_KVTIER_C_INTERNAL_H_
#define KVTIER_CLIENT_KVTIER_C_INTERNAL_H_

#include <memory>

#include "absl/status/status.h"
#include "client/kvtier_client.h"

// The client is shared with what reads through it: each kvtier_held and
// kvtier_gpu keeps it (and so its pool mapping) alive, so that bytes a
// caller still views stay mapped after kvtier_client_close.
struct kvtier_client {
  std::shared_ptr<kvtier::client::KvtierClient> impl;
};

namespace kvtier::capi {

// Records `st` as the calling thread's last error (kvtier_last_error) and
// returns its code. REQUIRES: !st.ok().
int Fail(const absl::Status& st);
// KVTIER_OK after clearing the last error for an OK `st`; Fail(st) otherwise.
int Done(const absl::Status& st);

}  // namespace kvtier::capi

#endif  // KVTIER_CLIENT_KVTIER_C_INTERNAL_H_
