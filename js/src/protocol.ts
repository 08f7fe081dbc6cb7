/**
 * The wire protocol between the gpumem kernel side (gpumem._frontend) and
 * this front-end extension. Keep in sync with src/gpumem/panel/frontend.py.
 */

/** Output mime type asking the front end to dock a panel in the sidebar. */
export const SIDEBAR_MIME = 'application/vnd.gpumem.sidebar+json';

/** ipywidgets' view mime type. */
export const WIDGET_VIEW_MIME = 'application/vnd.jupyter.widget-view+json';

/** Comm target carrying the status-bar figures (both directions may open it). */
export const STATUS_TARGET = 'gpumem.status';

/** Data of a SIDEBAR_MIME output. */
export interface ISidebarData {
  /** ipywidgets model id of the panel to dock. */
  model_id: string;
}

/** One CUDA device as seen by the kernel's PyTorch allocator. */
export interface IDeviceStatus {
  index: number;
  name?: string;
  allocated_bytes: number;
  reserved_bytes?: number;
  total_bytes?: number | null;
}

/** A status payload sent by the kernel about once a second. */
export interface IStatusPayload {
  devices: IDeviceStatus[];
  host?: { rss_bytes?: number | null };
  cuda_in_use: boolean;
  /** Model id of the kernel's live sidebar panel, when it has one: a page may dock it. */
  docked_model_id?: string | null;
}

/** Kernel -> front end messages on the status comm. */
export type KernelMessageData =
  | IStatusPayload
  | { sidebar_model_id: string }
  | { sidebar_error: string };

/**
 * Front end -> kernel requests on the status comm. `keepalive` is sent every
 * KEEPALIVE_MS so the kernel can drop comms of pages that went away; `bye`
 * when the page goes away (reload, tab closed), so that the kernel stops
 * counting the widget views of this page at once (they are never removed one
 * by one then).
 */
export type FrontendRequest =
  | { request: 'snapshot' }
  | { request: 'sidebar' }
  | { request: 'keepalive' }
  | { request: 'bye' };

export const KEEPALIVE_MS = 30000;

export function isStatusPayload(data: unknown): data is IStatusPayload {
  return (
    typeof data === 'object' &&
    data !== null &&
    Array.isArray((data as IStatusPayload).devices)
  );
}
